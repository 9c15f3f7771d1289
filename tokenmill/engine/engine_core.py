"""The engine core: a synchronous loop of schedule -> execute -> update over token ids.

It knows nothing of text or HTTP. A frontend (the offline `LLM`, or the server through an
EngineClient) adds requests, calls `step()` and turns the outputs into text and metrics.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import secrets
import time
from pathlib import Path

from tokenmill import tracing
from tokenmill.config import EngineConfig
from tokenmill.engine import request_span
from tokenmill.engine.fairness import MAX_TENANT_NAME
from tokenmill.engine.kv_cache_manager import KVCacheManager
from tokenmill.engine.kv_connector import KVSchedulerContext, build_scheduler_connector
from tokenmill.engine.pd_connector import validate_kv_transfer
from tokenmill.engine.protocol import EngineCoreOutput, EngineStats, TokenLogprobs
from tokenmill.engine.request import EngineRequest, FinishReason, Request
from tokenmill.engine.scheduler import Scheduler
from tokenmill.models.config import ModelConfig
from tokenmill.tokenizer.tokenizer import Tokenizer
from tokenmill.weights.tokenizer_source import load_tokenizer
from tokenmill.worker.executor import Executor, UniProcExecutor, WorkerDiedError, make_executor
from tokenmill.worker.kv_connector import connector_class, connector_names
from tokenmill.worker.kv_spec import KVCacheSpec
from tokenmill.worker.step import KVConnectorOutput, SchedulerOutput

log = logging.getLogger(__name__)

# Below this many tokens a pool too small for the model's context is an error, not a shorter context.
MIN_FITTED_LEN = 512


class EngineCore:
    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        # The KV connectors the configuration turns on (worker/kv_connector.py's registry), in chain order.
        self.kv_connector_names = connector_names(config)
        if self.kv_connector_names and not config.cache.enable_prefix_caching:
            raise ValueError(
                "--kv-offload and --kv-role need prefix caching: loaded blocks are named by hash"
            )
        # A setting a connector cannot work with fails here, with its reason, not in a rank.
        for name in self.kv_connector_names:
            connector_class(name, "scheduler").check_config(config)
        t0 = time.perf_counter()
        self.executor: Executor = make_executor(config)
        try:
            self._init_after_workers(config)
        except BaseException:
            self.executor.shutdown()
            raise
        self.load_seconds = time.perf_counter() - t0
        log.info(
            "engine ready in %.2fs: %s, %d KV blocks", self.load_seconds, Path(self.info["source"]).name,
            self.kv.pool.num_blocks,
        )  # fmt: skip

    def _window_on_every_layer(self) -> int:
        """The model's sliding window where every layer has it and it is shorter than the context (Mistral
        7B v0.1, Phi-3-mini-4k): then no layer reads a request's blocks behind it. 0 otherwise (Gemma 3's
        global layers read the whole context)."""
        m = self.model_config
        every = set(m.window_layers) >= set(range(m.num_layers))
        return m.sliding_window if every and 0 < m.sliding_window < self.max_model_len else 0

    def _init_after_workers(self, config: EngineConfig) -> None:
        self.info = self.executor.describe()
        self.model_config = ModelConfig.from_dict(self.info["model_config"])
        self.max_model_len: int = self.info["max_model_len"]
        if isinstance(self.executor, UniProcExecutor):
            self.tokenizer: Tokenizer = self.executor.worker.tokenizer
        else:
            cache_dir = Path(config.cache_dir) if config.cache_dir else None
            self.tokenizer = load_tokenizer(Path(self.info["source"]), cache_dir)
        cc = config.cache
        # One pool for all workers, sized so the worker with the costliest blocks fits its share.
        specs = self.executor.kv_cache_specs(cc.block_size)
        block_bytes = max(s.block_bytes for s in specs)
        num_blocks = cc.num_blocks or int(cc.kv_cache_memory_gb * 2**30 // block_bytes)
        need = -(-self.max_model_len // cc.block_size)
        fits = num_blocks * cc.block_size
        if num_blocks < need:
            if config.max_model_len is not None or fits < MIN_FITTED_LEN:
                raise ValueError(
                    f"the KV cache ({num_blocks} blocks of {cc.block_size} tokens) cannot hold one "
                    f"request of max_model_len={self.max_model_len} tokens (it holds {fits}); raise "
                    "kv_cache_memory_gb or lower max_model_len"
                )
            # The context length was not asked for, only defaulted from the model: a big model's
            # default pool (its KV is 196 KB a token at 1.7B parameters) then serves a shorter one
            # rather than refusing to start, and says so.
            log.warning(
                "the KV cache (%d blocks of %d tokens) holds %d tokens, fewer than the model's context of "
                "%d: max_model_len set to %d (raise kv_cache_memory_gb for more)",
                num_blocks, cc.block_size, fits, self.max_model_len, fits,
            )  # fmt: skip
            self.max_model_len = fits
        self.executor.allocate_kv_cache(num_blocks, cc.block_size)
        self.kv = KVCacheManager(
            num_blocks, cc.block_size, cc.enable_prefix_caching, config.kv_events.enable_kv_events,
            window=self._window_on_every_layer(),
        )  # fmt: skip
        self._attach_connectors(config, specs)
        max_loras = config.lora.max_loras if config.lora.enable_lora else 0
        self.scheduler = Scheduler(config.scheduler, self.kv, self.max_model_len, max_loras)
        if config.otlp_traces_endpoint:
            tracing.init(config.otlp_traces_endpoint, "engine")
            role, bs = config.kv_transfer.kv_role, self.kv.block_size
            self.scheduler.on_finished = lambda req: request_span.emit(req, role, bs)
        self.num_steps = 0
        self.num_batched_tokens_total = 0
        self.spec_num_drafts = self.spec_num_draft_tokens = self.spec_num_accepted_tokens = 0
        self.spec_accepted_per_pos: list[int] = []
        self.kv_connector_worker_stats: dict[str, int] = {}

    def _attach_connectors(self, config: EngineConfig, specs: list[KVCacheSpec]) -> None:
        """Both sides of the configured KV connectors: every rank builds its worker side and says what
        the scheduler side needs of it (an endpoint, a namespace), then the scheduler side is built."""
        names = self.kv_connector_names
        # Each connector's worker sides' facts, in rank order.
        self.kv_connector_info: dict[str, list[dict]] = {name: [] for name in names}
        if not names:
            return
        p = config.parallel
        # One key for the read grants of every rank's transfer server: the scheduler signs, each checks.
        keys = {"grant_key": secrets.token_bytes(32)}
        for rank_info in self.executor.init_kv_connector(names, [s.block_bytes for s in specs], keys):
            for name in names:
                self.kv_connector_info[name].append(rank_info[name])
        kv = self.kv
        contexts = [
            KVSchedulerContext(
                config,
                kv.block_size,
                kv.pool.num_blocks,
                specs,
                self.kv_connector_info[name],
                p.tensor_parallel_size,
                p.pipeline_parallel_size,
                kv.events,
                lambda h: kv.pool.lookup(h) is not None,
                keys,
            )  # fmt: skip
            for name in names
        ]
        connector = build_scheduler_connector(names, contexts)
        assert connector is not None
        kv.attach_connector(connector)

    def describe(self) -> dict:
        """Plain facts a frontend needs (the engine protocol's Ready info)."""
        return {
            "max_model_len": self.max_model_len,
            "vocab_size": self.model_config.vocab_size,
            "model_config": self.model_config.to_dict(),
            "num_blocks": self.kv.pool.num_blocks,
            "block_size": self.kv.block_size,
            "max_num_seqs": self.config.scheduler.max_num_seqs,  # a router's queue fills it, no more
            "load_seconds": self.load_seconds,
            "model": self.config.model,
            "pid": os.getpid(),
            "kv_role": self.config.kv_transfer.kv_role,
            # Where peers read this worker's blocks; the key of its read grants stays here.
            "kv_transfer": self._transfer_info(),
        }

    def _transfer_info(self) -> dict:
        """Rank 0's KV transfer server (and every rank's endpoint under tensor or pipeline parallelism),
        without the key of the read grants."""
        ranks = [
            {k: v for k, v in info.items() if k != "grant_key"}
            for info in self.kv_connector_info.get("pd", [])
        ]
        if not ranks or not ranks[0]:
            return {}
        return {**ranks[0], "endpoints": [r.get("endpoint") for r in ranks]} if len(ranks) > 1 else ranks[0]

    @property
    def runner(self):  # noqa: ANN201 - the in-process worker's ModelRunner (tests and tools)
        if not isinstance(self.executor, UniProcExecutor):
            raise AttributeError("the model runner lives in the worker processes")
        return self.executor.worker.runner

    def shutdown(self) -> None:
        connector = getattr(self, "kv", None) and self.kv.connector
        if connector is not None:
            # What the pool and the host tier hold goes to the file tiers, so a restart starts warm.
            meta = connector.flush_meta(self.kv.pool.cached_blocks())
            if meta is not None:
                try:
                    self.executor.execute_model(SchedulerOutput(kv_connector_metadata=meta))
                except Exception:
                    log.exception("could not write the KV cache to the offload tiers at shutdown")
        try:
            self.executor.shutdown()
        finally:
            tracing.flush()  # the last spans go out before the process ends

    # -- requests -----------------------------------------------------------------------------
    def add_request(self, req: EngineRequest) -> None:
        n = len(req.prompt_token_ids)
        if n == 0:
            raise ValueError("the prompt is empty")
        if n >= self.max_model_len:
            raise ValueError(
                f"the prompt has {n} tokens but the context length is {self.max_model_len}: "
                f"shorten the prompt to at most {self.max_model_len - 1} tokens"
            )
        vocab = self.model_config.vocab_size
        bad = [t for t in req.prompt_token_ids if not 0 <= t < vocab]
        if bad:
            raise ValueError(f"prompt token ids out of range [0, {vocab}): {bad[:5]}")
        p = req.sampling_params
        sequences = [t for s in p.stop_token_sequences for t in s]
        checked = (("stop_token_ids", p.stop_token_ids), ("logit_bias", list(p.logit_bias)))
        for name, ids in (*checked, ("stop_token_sequences", sequences)):
            bad = [t for t in ids if not 0 <= t < vocab]
            if bad:
                raise ValueError(f"{name} has token ids out of range [0, {vocab}): {bad[:5]}")
        if req.cache_salt is not None and "\x00" in req.cache_salt:
            raise ValueError("cache_salt may not contain a NUL character")
        if req.tenant is not None and len(req.tenant) > MAX_TENANT_NAME:
            raise ValueError(f"a tenant name has at most {MAX_TENANT_NAME} characters")
        if req.lora is not None and self.scheduler.loras is None:
            raise ValueError(f"the request names LoRA adapter {req.lora.lora_name!r}, but LoRA is off here")
        if req.trace_context is not None:  # only W3C's two keys, bounded
            req = dataclasses.replace(req, trace_context=tracing.clean_carrier(req.trace_context))
        if req.kv_transfer is not None:  # checked here, so a malformed one fails this request only
            req = dataclasses.replace(
                req,
                kv_transfer=validate_kv_transfer(req.kv_transfer, self.kv.block_size, self.max_model_len),
            )
            if self.kv.connector is not None:
                self.kv.connector.check_request(req.kv_transfer)
        self.scheduler.add_request(Request(req, self.max_model_len))

    def abort(self, request_ids: list[str]) -> list[EngineCoreOutput]:
        return [self._output(r, [], None, []) for r in self.scheduler.abort(request_ids)]

    def reset_prefix_cache(self) -> None:
        """Forget what the free blocks hold (blocks of running requests keep theirs); routers hear of
        each block removed, as of an eviction."""
        self.kv.pool.reset_prefix_cache()

    def finish(self, request_ids: list[str], reason: FinishReason = FinishReason.STOP) -> None:
        """End requests for a reason the frontend found (a stop string); frees their blocks."""
        self.scheduler.finish_requests(request_ids, reason)

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    # -- the loop -----------------------------------------------------------------------------
    def step(self) -> list[EngineCoreOutput]:
        out = self.scheduler.schedule()
        sched = self.scheduler
        idle = not out.num_scheduled_tokens and out.kv_connector_metadata is None and not out.lora_loads
        if idle and not sched.loading:
            if not sched.held:
                return []
            time.sleep(0.002)  # only kept blocks to watch for: look for their readers now and then
        try:
            result = self.executor.execute_model(out)
        except WorkerDiedError:
            raise  # no step can run any more: the engine is dead, and says so
        except Exception:
            # Nothing a request carries should make a forward pass fail (its inputs were checked on
            # arrival), so this is a bug: the step's requests end with an error, the engine goes on.
            # Blocks this step was filling may hold partial KV under a published hash: drop the cache.
            ids = out.scheduled_ids
            log.exception("engine step failed; its %d requests end with an error: %s", len(ids), ids)
            for slot in out.lora_loads:  # what the workers' slots hold is unknown now: read again
                sched.loras.failed(slot)  # type: ignore[union-attr]
            failed = self.scheduler.finish_requests(ids, FinishReason.ERROR)
            self.kv.pool.reset_prefix_cache()
            return [self._output(r, [], None, []) for r in failed]
        lora_failed = self._lora_failed(result.lora_failed) if result.lora_failed else []
        self._take_kv_output(result.kv_connector_output)
        if not out.num_scheduled_tokens:
            return lora_failed
        self.num_steps += 1
        self.num_batched_tokens_total += out.num_batched_tokens
        errors = result.errors
        sampled = {
            r: t for r, t in zip(result.req_ids, result.sampled_token_ids, strict=True) if r not in errors
        }
        lps = dict(zip(result.req_ids, result.logprobs, strict=True))
        if out.spec_token_ids:
            self._count_acceptance(out.spec_token_ids, sampled)
        outputs: list[EngineCoreOutput] = []
        # Before the update, which may finish (and forget) a request whose prompt this step ended.
        for rid, prompt_lps in result.prompt_logprobs.items():
            held = self.scheduler.requests.get(rid)
            if held is not None and not held.prompt_logprobs_sent:
                held.prompt_logprobs.extend(prompt_lps)
        for req, k in self.scheduler.update(out, sampled, result.spec_token_ids):
            lp = lps.get(req.request_id)
            new = req.output_token_ids[-k:]
            outputs.append(self._output(req, new, None if lp is None else lp[:k], req.token_times[-k:]))
        if result.pooled:  # embedding requests: their prompt is read, their vector is the answer
            done = self.scheduler.finish_requests(sorted(result.pooled), FinishReason.STOP)
            outputs.extend(self._output(r, [], None, [], pooled=result.pooled[r.request_id]) for r in done)
        if result.prompt_done:  # max_tokens 0: the prompt is read (and scored), nothing more
            done = self.scheduler.finish_requests(sorted(result.prompt_done), FinishReason.LENGTH)
            outputs.extend(self._output(r, [], None, []) for r in done)
        if errors:
            failed = self.scheduler.finish_requests(sorted(errors), FinishReason.ERROR)
            outputs.extend(
                self._output(r, [], None, [], result.client_errors.get(r.request_id)) for r in failed
            )
        if lora_failed:
            outputs.extend(lora_failed)
            # Blocks this step named under the adapter were computed without it: forget them (their
            # requests have ended, so the blocks are free).
            self.kv.pool.reset_prefix_cache()
        return outputs

    def _lora_failed(self, failed: dict[int, str]) -> list[EngineCoreOutput]:
        """Slots the workers could not read an adapter into: every request holding one ends with the
        reason (those in this step are among the step's errors too), and the slot holds nothing."""
        sched = self.scheduler
        assert sched.loras is not None
        held = [r for r in [*sched.requests.values(), *sched.loading.values()] if r.lora_slot in failed]
        reasons = {r.request_id: failed[r.lora_slot] for r in held}
        for slot in failed:
            sched.loras.failed(slot)
        ended = sched.finish_requests(sorted(reasons), FinishReason.ERROR)
        return [self._output(r, [], None, [], reasons[r.request_id]) for r in ended]

    def _count_acceptance(self, drafts: dict[str, list[int]], sampled: dict[str, list[int]]) -> None:
        for rid, draft in drafts.items():
            new = sampled.get(rid)
            if not new:
                continue
            accepted = len(new) - 1
            self.spec_num_drafts += 1
            self.spec_num_draft_tokens += len(draft)
            self.spec_num_accepted_tokens += accepted
            per_pos = self.spec_accepted_per_pos
            if len(per_pos) < len(draft):
                per_pos.extend([0] * (len(draft) - len(per_pos)))
            for i in range(accepted):
                per_pos[i] += 1

    def _output(
        self,
        req: Request,
        new: list[int],
        lps: list[TokenLogprobs] | None,
        times: list[float],
        error: str | None = None,
        pooled: bytes | None = None,
    ) -> EngineCoreOutput:
        prompt_lps = None
        if req.params.prompt_logprobs is not None and not req.prompt_logprobs_sent:
            prompt_lps, req.prompt_logprobs, req.prompt_logprobs_sent = req.prompt_logprobs, [], True
        return EngineCoreOutput(
            request_id=req.request_id,
            prompt_logprobs=prompt_lps,
            new_token_ids=new,
            new_logprobs=lps,
            finish_reason=req.finish_reason,
            stop_token=req.stop_token,
            num_prompt_tokens=req.num_prompt_tokens,
            num_cached_tokens=max(req.num_cached_tokens, 0),
            num_preemptions=req.num_preemptions,
            arrival_time=req.arrival_time,
            first_scheduled_time=req.first_scheduled_time,
            first_token_time=req.first_token_time,
            finished_time=req.finished_time,
            new_token_times=times,
            kv_transfer=req.kv_transfer_out if req.finish_reason is not None else None,
            error=error,
            pooled=pooled,
        )

    def stats(self) -> EngineStats:
        threads, thread_changes = self.executor.compute_threads()
        return EngineStats(
            num_running=len(self.scheduler.running),
            num_waiting=self.scheduler.num_waiting,
            kv_cache_usage=self.kv.usage,
            num_blocks=self.kv.pool.num_blocks,
            prefix_cache_queries=self.kv.prefix_cache_queries,
            prefix_cache_hits=self.kv.prefix_cache_hits,
            num_preemptions=self.scheduler.num_preemptions,
            num_steps=self.num_steps,
            num_batched_tokens_total=self.num_batched_tokens_total,
            spec_num_drafts=self.spec_num_drafts,
            spec_num_draft_tokens=self.spec_num_draft_tokens,
            spec_num_accepted_tokens=self.spec_num_accepted_tokens,
            spec_accepted_per_pos=list(self.spec_accepted_per_pos),
            kv_connector=self._connector_counters(),
            engine_threads=threads,
            engine_thread_changes=thread_changes,
            tenant_tokens=self.scheduler.tenants.snapshot(),
            **self._lora_stats(),
        )

    def _lora_stats(self) -> dict:
        loras = self.scheduler.loras
        if loras is None:
            return {}
        return {
            "lora_slots": len(loras.ids),
            "lora_resident": loras.resident_names,
            "lora_running": loras.running_names,
            "lora_free_slots": loras.free,
        }

    def _take_kv_output(self, kvo: KVConnectorOutput | None) -> None:
        """What the workers' KV connectors reported after a step: finished loads, readers done with kept
        blocks, tier events, counters."""
        connector = self.kv.connector
        if kvo is None or connector is None:
            return
        self.kv_connector_worker_stats = kvo.stats
        loads_done, released = connector.update_from_workers(kvo)
        if loads_done:
            self.scheduler.finish_loads(loads_done)
        if released:
            self.scheduler.release_held(released)

    def poll_kv_connector(self) -> dict[str, int]:
        """A step of nothing but the KV connectors' reports (taken in as after any step), for a caller
        that waits on the workers' background work: the connectors' counters after it (a test waits for
        `file_writes_queued` to reach 0, every queued write in its file tier)."""
        if self.kv.connector is None:
            return {}
        self._take_kv_output(self.executor.execute_model(SchedulerOutput()).kv_connector_output)
        return self._connector_counters()

    def _connector_counters(self) -> dict[str, int]:
        connector = self.kv.connector
        if connector is None:
            return {}
        return {**connector.counters(), **self.kv_connector_worker_stats}
