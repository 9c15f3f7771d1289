"""The engine core: a synchronous loop of schedule -> execute -> update over token ids.

It knows nothing of text or HTTP. A frontend (the offline `LLM`, or the server through an
EngineClient) adds requests, calls `step()` and turns the outputs into text and metrics.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from tokenmill.config import EngineConfig
from tokenmill.engine.kv_cache_manager import KVCacheManager
from tokenmill.engine.request import EngineRequest, FinishReason, Request
from tokenmill.engine.runner import ModelRunner
from tokenmill.engine.sampler import TokenLogprobs
from tokenmill.engine.scheduler import Scheduler
from tokenmill.engine.thread_governor import make_governor
from tokenmill.models.config import ModelConfig
from tokenmill.models.llama import build_model
from tokenmill.tokenizer.tokenizer import Tokenizer
from tokenmill.weights import catalog, loader

log = logging.getLogger(__name__)

DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32, "float16": torch.float16}
DEFAULT_MAX_MODEL_LEN = 8192


@dataclass
class EngineCoreOutput:
    request_id: str
    new_token_ids: list[int]
    new_logprobs: list[TokenLogprobs] | None = None
    finish_reason: FinishReason | None = None
    stop_token: int | None = None
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0
    num_preemptions: int = 0
    arrival_time: float = 0.0
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    finished_time: float | None = None
    new_token_times: list[float] = field(default_factory=list)


@dataclass
class EngineStats:
    num_running: int
    num_waiting: int
    kv_cache_usage: float
    num_blocks: int
    prefix_cache_queries: int
    prefix_cache_hits: int
    num_preemptions: int
    num_steps: int
    num_batched_tokens_total: int


class EngineCore:
    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        if config.num_threads:
            torch.set_num_threads(config.num_threads)
        self.governor = make_governor(config.adaptive_threads)
        if config.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {', '.join(DTYPES)}, got {config.dtype!r}")
        self.dtype = DTYPES[config.dtype]
        self.device = torch.device(config.device)

        t0 = time.perf_counter()
        path = catalog.resolve(config.model)
        cache_dir = Path(config.cache_dir) if config.cache_dir else None
        loaded = loader.load(path, self.dtype, cache_dir)
        self.model_config: ModelConfig = loaded.config
        self.tokenizer: Tokenizer = loaded.tokenizer
        mc = self.model_config
        self.max_model_len = config.max_model_len or min(mc.max_position_embeddings, DEFAULT_MAX_MODEL_LEN)
        model = build_model(
            mc,
            loaded.state_dict,
            self.dtype,
            self.device,
            self.max_model_len,
            config.kernels,
            config.quantization,
        )
        del loaded

        cc = config.cache
        self.block_size = cc.block_size
        elem = torch.tensor([], dtype=self.dtype).element_size()
        block_bytes = 2 * mc.num_layers * cc.block_size * mc.num_kv_heads * mc.head_dim * elem
        num_blocks = cc.num_blocks or int(cc.kv_cache_memory_gb * 2**30 // block_bytes)
        need = -(-self.max_model_len // cc.block_size)
        if num_blocks < need:
            raise ValueError(
                f"the KV cache ({num_blocks} blocks of {cc.block_size} tokens) cannot hold one request of "
                f"max_model_len={self.max_model_len} tokens; raise kv_cache_memory_gb or lower max_model_len"
            )
        self.kv = KVCacheManager(num_blocks, cc.block_size, cc.enable_prefix_caching)
        self.runner = ModelRunner(
            model,
            mc,
            num_blocks,
            cc.block_size,
            self.dtype,
            self.device,
            config.kernels,
            config.seed,
        )
        self.scheduler = Scheduler(config.scheduler, self.kv, self.max_model_len)
        self.num_steps = 0
        self.num_batched_tokens_total = 0
        self.load_seconds = time.perf_counter() - t0
        log.info("engine ready in %.2fs: %s, %d KV blocks", self.load_seconds, path.name, num_blocks)

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
        for name, ids in (("stop_token_ids", p.stop_token_ids), ("logit_bias", list(p.logit_bias))):
            bad = [t for t in ids if not 0 <= t < vocab]
            if bad:
                raise ValueError(f"{name} has token ids out of range [0, {vocab}): {bad[:5]}")
        self.scheduler.add_request(Request(req, self.max_model_len))

    def abort(self, request_ids: list[str]) -> list[EngineCoreOutput]:
        return [self._output(r, [], None, []) for r in self.scheduler.abort(request_ids)]

    def finish(self, request_ids: list[str], reason: FinishReason = FinishReason.STOP) -> None:
        """End requests for a reason the frontend found (a stop string); frees their blocks."""
        self.scheduler.finish_requests(request_ids, reason)

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    # -- the loop -----------------------------------------------------------------------------
    def step(self) -> list[EngineCoreOutput]:
        out = self.scheduler.schedule()
        if not out.scheduled:
            return []
        try:
            req_ids, result = self.runner.execute(out, self.kv)
        except Exception:
            # Nothing a request carries should make a forward pass fail (its inputs were checked on
            # arrival), so this is a bug: the step's requests end with an error, the engine goes on.
            # Blocks this step was filling may hold partial KV under a published hash: drop the cache.
            ids = [s.request.request_id for s in out.scheduled]
            log.exception("engine step failed; its %d requests end with an error: %s", len(ids), ids)
            failed = self.scheduler.finish_requests(ids, FinishReason.ERROR)
            self.kv.pool.reset_prefix_cache()
            return [self._output(r, [], None, []) for r in failed]
        self.num_steps += 1
        self.num_batched_tokens_total += out.num_batched_tokens
        if self.governor is not None:
            self.governor.tick()
        errors = {req_ids[i] for i in result.errors}
        sampled = {r: t for r, t in zip(req_ids, result.token_ids, strict=True) if r not in errors}
        lps = dict(zip(req_ids, result.logprobs, strict=True))
        outputs = []
        for req in self.scheduler.update(out, sampled):
            lp = lps.get(req.request_id)
            outputs.append(
                self._output(
                    req, [req.output_token_ids[-1]], [lp] if lp is not None else None, req.token_times[-1:]
                )
            )
        if errors:
            failed = self.scheduler.finish_requests(sorted(errors), FinishReason.ERROR)
            outputs.extend(self._output(r, [], None, []) for r in failed)
        return outputs

    def _output(
        self, req: Request, new: list[int], lps: list[TokenLogprobs] | None, times: list[float]
    ) -> EngineCoreOutput:
        return EngineCoreOutput(
            request_id=req.request_id,
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
        )

    def stats(self) -> EngineStats:
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
        )
