"""The model runner: the model, this worker's part of the paged KV cache, and the requests it holds.

It applies a step's diffs to what it remembers of each request, turns the step into tensors, runs the
forward pass (passing activations between pipeline stages) and samples, on the rank that samples.
"""

from __future__ import annotations

import time

import torch

from tokenmill.lora.model import LoRAModel
from tokenmill.models.attention.backend import AttentionBackend, AttentionMetadata, PrefillSegment
from tokenmill.models.attention.registry import get_backend
from tokenmill.models.decode_step import decode_step_for
from tokenmill.models.llama import LlamaForCausalLM
from tokenmill.worker import huge_pages
from tokenmill.worker.grammars import RequestGrammars
from tokenmill.worker.kv_spec import KVCacheSpec
from tokenmill.worker.parallel_state import ParallelState
from tokenmill.worker.request_state import CachedRequestState
from tokenmill.worker.sampler import Sampler
from tokenmill.worker.spec_decode.speculator import Speculator
from tokenmill.worker.step import ModelRunnerOutput, SchedulerOutput, TokenLogprobs


class ModelRunner:
    def __init__(
        self,
        model: LlamaForCausalLM,
        kv_spec: KVCacheSpec,
        num_blocks: int,
        dtype: torch.dtype,
        device: torch.device,
        backend: str = "torch",
        seed: int = 0,
        parallel: ParallelState | None = None,
        speculator: Speculator | None = None,
        grammars: RequestGrammars | None = None,
        kv_caches: torch.Tensor | None = None,
    ) -> None:
        self.model = model
        # Pure decode steps as one C++ call where every layer's kernels allow (models/decode_step.py), on
        # the weights as they are now: by then the model holds its own copies of the checkpoint's norms and
        # biases (models/own_weights.py), which the step must hold rather than the mapped file's views.
        model.layer_loop = decode_step_for(model)
        self.block_size = kv_spec.block_size
        self.device = device
        self.dtype = dtype
        self.parallel = parallel or ParallelState.single()
        self.backend: AttentionBackend = get_backend(backend, device.type, kv_spec.kv_format)
        self.sampler = Sampler(seed, ops=model.ops)
        self.requests: dict[str, CachedRequestState] = {}
        # Given when it must live somewhere particular (shared memory that KV transfer peers map).
        self.kv_caches = (
            kv_caches
            if kv_caches is not None
            else huge_pages.zeros(
                kv_spec.tensor_shape(num_blocks), dtype=kv_spec.storage_dtype(dtype), device=device
            )
        )
        # Both live on the sampling rank only: they act on sampled tokens.
        self.speculator = speculator if self.parallel.samples else None
        self.grammars = grammars if self.parallel.samples else None

    # -- what the worker remembers ----------------------------------------------------------------
    def _update_states(self, out: SchedulerOutput) -> None:
        if out.finished_req_ids:
            if self.speculator is not None:
                finished = [self.requests[r] for r in out.finished_req_ids if r in self.requests]
                self.speculator.forget(
                    out.finished_req_ids, {st.request_id: st.output_token_ids for st in finished}
                )
            if self.grammars is not None:
                self.grammars.forget(out.finished_req_ids)
        for rid in out.finished_req_ids:
            self.requests.pop(rid, None)
        if out.preempted_req_ids:
            if self.speculator is not None:
                self.speculator.forget(out.preempted_req_ids, None)
            if self.grammars is not None:
                self.grammars.forget(out.preempted_req_ids)
        for rid in out.preempted_req_ids:
            self.requests.pop(rid, None)
        for new in out.new_requests:
            st = self.requests[new.request_id] = CachedRequestState(new)
            if self.grammars is not None:
                self.grammars.add(st)
        for run in out.running_requests:
            st = self.requests[run.request_id]
            st.all_token_ids.extend(run.new_token_ids)
            st.block_ids.extend(run.new_block_ids)

    # -- one step -----------------------------------------------------------------------------------
    def execute(self, out: SchedulerOutput) -> ModelRunnerOutput:
        """Run one forward pass; on the sampling rank, return each finished-prompt request's new tokens
        (accepted drafts and one more) and, when speculating, the next drafts."""
        self._update_states(out)
        lora = self.model.lora
        failed = self._load_loras(lora, out.lora_loads) if lora is not None and out.lora_loads else {}
        if not out.num_scheduled_tokens:
            return ModelRunnerOutput(lora_failed=failed)
        try:
            output = self._step(out, lora)
        finally:
            if lora is not None:
                lora.set_segments([])
        if failed:  # requests on an adapter that could not be read fail alone, saying why
            for rid in out.num_scheduled_tokens:
                slot = self.requests[rid].lora_slot
                if slot in failed:
                    output.errors[rid] = output.client_errors[rid] = failed[slot]
            output.lora_failed = failed
        return output

    def _load_loras(self, lora: LoRAModel, loads: dict[int, tuple[int, str]]) -> dict[int, str]:
        """Read adapters into the slots the engine gave them; slot -> why, for those that failed."""
        failed: dict[int, str] = {}
        for slot, (lora_id, path) in loads.items():
            try:
                lora.load(slot, lora_id, path)
            except Exception as e:  # noqa: BLE001 - whatever the files hold now, the step goes on
                lora.clear(slot)
                failed[slot] = f"the LoRA adapter at {path!r} could not be loaded: {e}"
        return failed

    def _step(self, out: SchedulerOutput, lora: LoRAModel | None) -> ModelRunnerOutput:
        t0 = time.perf_counter()
        bs = self.block_size
        starts = out.num_computed_before()
        spec = out.spec_token_ids
        sched = [(self.requests[rid], starts[rid], n) for rid, n in out.num_scheduled_tokens.items()]
        # Decode rows (one new token) first, then prefill segments: the backend batches the former. A
        # request verifying drafts is several decode rows, one per position: the step writes all of
        # their keys and values before any row attends, so row i sees the drafts before it.
        decodes = [s for s in sched if s[2] == 1 or s[0].request_id in spec]
        prefills = [s for s in sched if s[2] > 1 and s[0].request_id not in spec]
        if lora is not None:  # rows on one adapter side by side: a segment each (lora/layer.py)
            decodes.sort(key=lambda s: s[0].lora_slot)
            prefills.sort(key=lambda s: s[0].lora_slot)
        lora_rows: list[tuple[int, int, int]] = []

        token_ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        logits_rows: list[int] = []
        sampled: list[CachedRequestState] = []
        drafts: list[list[int]] = []
        segments: list[PrefillSegment] = []
        tables: list[list[int]] = []
        ctx_lens: list[int] = []
        pool_rows: list[int] = []  # rows whose hidden states embedding requests pool
        pool_owners: list[CachedRequestState] = []  # the request of each of those rows
        pooled: list[CachedRequestState] = []  # embedding requests whose prompt this step ends
        prompt_done: list[str] = []  # max_tokens 0 requests whose prompt this step ends
        prompt_lp_rows: list[int] = []  # rows whose logits give prompt logprobs, after the sampled ones
        prompt_lp: list[tuple[CachedRequestState, int, int]] = []  # (request, first position, rows)
        for st, start, n in decodes + prefills:
            end = start + n
            block_ids = st.block_ids
            draft = spec.get(st.request_id, [])
            q_start = len(token_ids)
            token_ids.extend(st.all_token_ids[start:end])
            token_ids.extend(draft)
            if st.lora_slot >= 0:
                _add_segment(lora_rows, q_start, len(token_ids), st.lora_slot)
            positions.extend(range(start, end))
            slots.extend(block_ids[p // bs] * bs + p % bs for p in range(start, end))
            if n == 1 or draft:
                for p in range(start, end):
                    tables.append(block_ids[: p // bs + 1])
                    ctx_lens.append(p + 1)
            else:
                ids = block_ids[: (end + bs - 1) // bs]
                seg = PrefillSegment(q_start, n, start, torch.tensor(ids, dtype=torch.long))
                if ids == list(range(ids[0], ids[0] + len(ids))):  # a run: the context is a cache slice
                    seg.first_block = ids[0]
                segments.append(seg)
            if st.params.prompt_logprobs is not None:  # rows predicting the prompt's next tokens
                last = min(end, len(st.prompt_token_ids) - 1)  # position p predicts token p + 1
                prompt_lp_rows.extend(range(q_start, q_start + max(last - start, 0)))
                prompt_lp.append((st, start, max(last - start, 0)))
            if st.params.pooling is not None:  # an embedding request: pooled, never sampled
                rows = _pooled_rows(st.params.pooling, q_start, start, end, st.num_tokens)
                pool_rows.extend(rows)
                pool_owners.extend([st] * len(rows))
                if end == st.num_tokens:
                    pooled.append(st)
            elif st.params.max_tokens == 0:  # prompt scoring: read it, sample nothing
                if end == st.num_tokens:
                    prompt_done.append(st.request_id)
            elif end - len(draft) == st.num_tokens:  # the step completes its known tokens: sample
                logits_rows.extend(range(len(token_ids) - len(draft) - 1, len(token_ids)))
                sampled.append(st)
                drafts.append(draft)

        dev = self.device
        meta = AttentionMetadata.of(slots, tables, ctx_lens, segments, bs, dev)
        hidden_rows = bool(pool_rows or prompt_lp_rows)

        ps = self.parallel
        if ps.is_first_stage:
            inputs = torch.tensor(token_ids, dtype=torch.long, device=dev)
        else:
            inputs = ps.recv_activations((len(token_ids), self.model.config.hidden_size), self.dtype, dev)
        if lora is not None:
            lora.set_segments(lora_rows)
        result = self.model(
            inputs,
            torch.tensor(positions, dtype=torch.long, device=dev),
            self.kv_caches,
            meta,
            self.backend,
            torch.tensor(logits_rows, dtype=torch.long, device=dev),
            # The final hidden states of pooled rows, then of rows whose logits give prompt logprobs.
            torch.tensor(pool_rows + prompt_lp_rows, dtype=torch.long, device=dev) if hidden_rows else None,
        )
        if not ps.is_last_stage:
            ps.send_activations(result)
            return ModelRunnerOutput()
        prompt_lps: dict[str, list[TokenLogprobs]] = {}
        if hidden_rows:
            result, hidden = result
            if prompt_lp_rows:  # on every rank of the stage: the head is a collective under TP
                prompt_lps = _prompt_logprobs(self.model, hidden[len(pool_rows) :], prompt_lp)
        if not ps.samples:
            return ModelRunnerOutput()
        # Requests that read their prompt without sampling it (embeddings, max_tokens 0), and prompt
        # logprobs.
        prompt_only = ModelRunnerOutput(prompt_done=prompt_done, prompt_logprobs=prompt_lps)
        if pool_rows:
            prompt_only.pooled = _pool(hidden[: len(pool_rows)], pool_owners, pooled)
        if not sampled:
            return prompt_only
        bitmask = self.grammars.bitmask(sampled, drafts, result.shape[-1]) if self.grammars else None
        res = self.sampler(result.cpu(), sampled, drafts, bitmask)
        errors = {sampled[i].request_id: msg for i, msg in res.errors.items()}
        ids = [st.request_id for st in sampled]
        client_errors: dict[str, str] = {}
        if self.grammars:
            failed, client_errors = self.grammars.advance(sampled, res.token_ids, errors)
            errors.update(failed)
        output = ModelRunnerOutput(
            req_ids=ids,
            sampled_token_ids=[[] if ids[i] in errors else t for i, t in enumerate(res.token_ids)],
            logprobs=res.logprobs,
            errors=errors,
            client_errors=client_errors,
            pooled=prompt_only.pooled,
            prompt_logprobs=prompt_only.prompt_logprobs,
            prompt_done=prompt_done,
        )
        if self.speculator is not None:
            # A step that also read prompts says nothing about what decoding with or without drafts
            # costs: only pure decode steps are timed for the speculator.
            step_seconds = None if segments else time.perf_counter() - t0
            output.spec_token_ids = self.speculator.propose(sampled, output, drafts, step_seconds)
        output.execute_seconds = time.perf_counter() - t0
        return output


def _add_segment(segments: list[tuple[int, int, int]], start: int, end: int, slot: int) -> None:
    """Rows [start, end) run on LoRA slot `slot`: extend the last segment where they continue it."""
    if segments and segments[-1][1] == start and segments[-1][2] == slot:
        segments[-1] = (segments[-1][0], end, slot)
    else:
        segments.append((start, end, slot))


# Rows of prompt logprobs computed at once: a row's logits are the vocabulary wide (128k floats for Llama
# 3), so a long prompt's are made a slice at a time rather than all in one tensor.
PROMPT_LOGPROB_ROWS = 256


@torch.inference_mode()  # as the forward pass: its hidden states are inference tensors
def _prompt_logprobs(
    model: LlamaForCausalLM, hidden: torch.Tensor, requests: list[tuple[CachedRequestState, int, int]]
) -> dict[str, list[TokenLogprobs]]:
    """Each request's logprobs of the prompt tokens its rows predict (row p: token p + 1), with its top
    alternatives, from the model's logits of final-norm hidden states, as the sampler gives generated
    tokens theirs."""
    targets: list[int] = []
    ks: list[int] = []
    for st, start, n in requests:
        targets += st.prompt_token_ids[start + 1 : start + 1 + n]
        ks += [st.params.prompt_logprobs or 0] * n
    k_max = max(ks, default=0)
    chosen: list[float] = []
    top_v: list[list[float]] = []
    top_i: list[list[int]] = []
    for a in range(0, len(targets), PROMPT_LOGPROB_ROWS):
        b = min(a + PROMPT_LOGPROB_ROWS, len(targets))
        logits = model.head(hidden[a:b]).float()
        norm = torch.logsumexp(logits, dim=-1, keepdim=True)
        index = torch.tensor(targets[a:b], dtype=torch.long, device=logits.device).unsqueeze(1)
        chosen += (logits.gather(1, index) - norm)[:, 0].cpu().tolist()
        if k_max:
            v, i = logits.topk(k_max, dim=-1)
            top_v += (v - norm).cpu().tolist()
            top_i += i.cpu().tolist()
    out: dict[str, list[TokenLogprobs]] = {}
    row = 0
    for st, _, n in requests:
        entries = out.setdefault(st.request_id, [])
        for j in range(row, row + n):
            k = ks[j]
            top = list(zip(top_i[j][:k], top_v[j][:k], strict=True)) if k else []
            entries.append(TokenLogprobs(targets[j], chosen[j], top))
        row += n
    return out


def _pooled_rows(pooling: str, q_start: int, start: int, end: int, num_tokens: int) -> list[int]:
    """The step rows (from q_start, for positions start..end-1) an embedding request pools."""
    if pooling == "mean":
        return list(range(q_start, q_start + end - start))
    if pooling == "cls":
        return [q_start] if start == 0 else []
    return [q_start + end - start - 1] if end == num_tokens else []  # "last"


def _pool(
    hidden: torch.Tensor, owners: list[CachedRequestState], done: list[CachedRequestState]
) -> dict[str, bytes]:
    """Add this step's pooled rows to their requests; the vectors of those whose prompt ended, as
    float32 bytes. Sums are float32 whatever the model's dtype, as a mean over a long prompt needs."""
    rows = hidden.float().cpu()
    start = 0
    while start < len(owners):
        st, stop = owners[start], start + 1
        while stop < len(owners) and owners[stop] is st:
            stop += 1
        part = rows[start:stop].sum(0)
        st.pool_sum = part if st.pool_sum is None else st.pool_sum + part
        st.pool_rows += stop - start
        start = stop
    out = {}
    for st in done:
        vector = st.pool_sum / max(st.pool_rows, 1)
        out[st.request_id] = vector.numpy().astype("<f4").tobytes()
    return out
