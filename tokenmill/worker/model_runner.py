"""The model runner: the model, this worker's part of the paged KV cache, and the requests it holds.

It applies a step's diffs to what it remembers of each request, turns the step into tensors, runs the
forward pass (passing activations between pipeline stages) and samples, on the rank that samples.
"""

from __future__ import annotations

import time

import torch

from tokenmill.models.attention.backend import AttentionBackend, AttentionMetadata, PrefillSegment
from tokenmill.models.attention.registry import get_backend
from tokenmill.models.llama import LlamaForCausalLM
from tokenmill.worker.kv_spec import KVCacheSpec
from tokenmill.worker.parallel_state import ParallelState
from tokenmill.worker.request_state import CachedRequestState
from tokenmill.worker.sampler import Sampler
from tokenmill.worker.step import ModelRunnerOutput, SchedulerOutput


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
    ) -> None:
        self.model = model
        self.block_size = kv_spec.block_size
        self.device = device
        self.dtype = dtype
        self.parallel = parallel or ParallelState.single()
        self.backend: AttentionBackend = get_backend(backend, device.type)
        self.sampler = Sampler(seed)
        self.requests: dict[str, CachedRequestState] = {}
        # Kept across preemptions, so a seeded request's draws continue where they stopped.
        self.generators: dict[str, torch.Generator] = {}
        self.kv_caches = torch.zeros(kv_spec.tensor_shape(num_blocks), dtype=dtype, device=device)

    # -- what the worker remembers ----------------------------------------------------------------
    def _update_states(self, out: SchedulerOutput) -> None:
        for rid in out.finished_req_ids:
            self.requests.pop(rid, None)
            self.generators.pop(rid, None)
        for rid in out.preempted_req_ids:
            self.requests.pop(rid, None)
        for new in out.new_requests:
            gen = self.generators.get(new.request_id)
            if gen is None and new.sampling_params.seed is not None:
                gen = torch.Generator().manual_seed(new.sampling_params.seed)
                self.generators[new.request_id] = gen
            self.requests[new.request_id] = CachedRequestState(new, gen)
        for run in out.running_requests:
            st = self.requests[run.request_id]
            st.all_token_ids.extend(run.new_token_ids)
            st.block_ids.extend(run.new_block_ids)

    # -- one step -----------------------------------------------------------------------------------
    def execute(self, out: SchedulerOutput) -> ModelRunnerOutput:
        """Run one forward pass; on the sampling rank, return each finished-prompt request's new token."""
        self._update_states(out)
        if not out.num_scheduled_tokens:
            return ModelRunnerOutput()
        t0 = time.perf_counter()
        bs = self.block_size
        starts = out.num_computed_before()
        sched = [(self.requests[rid], starts[rid], n) for rid, n in out.num_scheduled_tokens.items()]
        # Decode rows (one new token) first, then prefill segments: the backend batches the former.
        decodes = [s for s in sched if s[2] == 1]
        prefills = [s for s in sched if s[2] > 1]

        token_ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        logits_rows: list[int] = []
        sampled: list[CachedRequestState] = []
        segments: list[PrefillSegment] = []
        tables: list[list[int]] = []
        for st, start, n in decodes + prefills:
            end = start + n
            block_ids = st.block_ids
            q_start = len(token_ids)
            token_ids.extend(st.all_token_ids[start:end])
            positions.extend(range(start, end))
            slots.extend(block_ids[p // bs] * bs + p % bs for p in range(start, end))
            if n == 1:
                tables.append(block_ids[: (end + bs - 1) // bs])
            else:
                ids = block_ids[: (end + bs - 1) // bs]
                seg = PrefillSegment(q_start, n, start, torch.tensor(ids, dtype=torch.long))
                if ids == list(range(ids[0], ids[0] + len(ids))):  # a run: the context is a cache slice
                    seg.first_block = ids[0]
                segments.append(seg)
            if end == st.num_tokens:  # the step completes its known tokens: the last logits give a new one
                logits_rows.append(len(token_ids) - 1)
                sampled.append(st)

        dev = self.device
        meta = AttentionMetadata(
            slot_mapping=torch.tensor(slots, dtype=torch.long, device=dev),
            num_decode=len(decodes),
            decode_block_tables=None,
            decode_context_lens=None,
            prefills=segments,
            block_size=bs,
        )
        if decodes:
            max_blocks = max(len(t) for t in tables)
            bt = torch.zeros(len(tables), max_blocks, dtype=torch.long)
            for i, t in enumerate(tables):
                bt[i, : len(t)] = torch.tensor(t, dtype=torch.long)
            ctx = torch.tensor([start + 1 for _, start, _ in decodes], dtype=torch.long)
            meta.decode_block_tables = bt.to(dev)
            meta.decode_context_lens = ctx.to(dev)
        for seg in segments:
            seg.block_ids = seg.block_ids.to(dev)

        ps = self.parallel
        if ps.is_first_stage:
            inputs = torch.tensor(token_ids, dtype=torch.long, device=dev)
        else:
            inputs = ps.recv_activations((len(token_ids), self.model.config.hidden_size), self.dtype, dev)
        result = self.model(
            inputs,
            torch.tensor(positions, dtype=torch.long, device=dev),
            self.kv_caches,
            meta,
            self.backend,
            torch.tensor(logits_rows, dtype=torch.long, device=dev),
        )
        if not ps.is_last_stage:
            ps.send_activations(result)
            return ModelRunnerOutput()
        if not ps.samples or not sampled:
            return ModelRunnerOutput()
        res = self.sampler(result.cpu(), sampled)
        errors = {sampled[i].request_id: msg for i, msg in res.errors.items()}
        ids = [st.request_id for st in sampled]
        return ModelRunnerOutput(
            req_ids=ids,
            sampled_token_ids=[[] if ids[i] in errors else [t] for i, t in enumerate(res.token_ids)],
            logprobs=[None if lp is None else [lp] for lp in res.logprobs],
            errors=errors,
            execute_seconds=time.perf_counter() - t0,
        )
