"""A request as the engine core sees it: token ids in, token ids out, and its place in the KV cache."""

from __future__ import annotations

import enum
import time

from tokenmill.engine.fairness import DEFAULT_TENANT
from tokenmill.engine.protocol import EngineRequest, FinishReason
from tokenmill.lora.request import kv_salt

__all__ = ["EngineRequest", "FinishReason", "Request", "RequestStatus"]


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    PREEMPTED = "preempted"
    # Holding blocks whose content a KV connector is loading in the background (offload tiers).
    WAITING_FOR_KV = "waiting_for_kv"
    FINISHED = "finished"


class Request:
    def __init__(self, req: EngineRequest, max_model_len: int) -> None:
        self.request_id = req.request_id
        self.prompt_token_ids = list(req.prompt_token_ids)
        self.params = req.sampling_params
        self.eos_token_ids = req.eos_token_ids
        self.arrival_time = req.arrival_time
        self.priority = req.priority
        # Who it is served for (the scheduler names it: fairness.py), and how many of its prompt tokens
        # have been counted as served to them (recomputing after a preemption counts nothing again).
        self.tenant = req.tenant or DEFAULT_TENANT
        self.num_prompt_charged = 0
        self.cache_salt = req.cache_salt
        self.lora = req.lora
        self.lora_slot = -1  # the LoRA slot it holds while admitted (-1: none)
        # What its blocks' hashes are salted with: the cache salt and the adapter (lora/request.py).
        self.hash_salt = kv_salt(req.cache_salt, req.lora)
        self.kv_transfer = req.kv_transfer
        self.kv_transfer_out: dict | None = None  # what a connector says of it when it finishes
        self.all_token_ids: list[int] = list(req.prompt_token_ids)
        self.output_token_ids: list[int] = []
        self.num_computed_tokens = 0
        # How much of this request the workers hold (tokens, block ids); 0 when they hold none of it.
        self.num_sent_tokens = 0
        self.num_sent_blocks = 0
        self.status = RequestStatus.WAITING
        self.finish_reason: FinishReason | None = None
        self.stop_token: int | None = None
        # Hashes of this request's full blocks, extended as tokens arrive (see block_hash.py).
        self.block_hashes: list[bytes] = []
        # Draft tokens a proposer guessed after the last step, verified in the next (never in
        # all_token_ids: they are not the request's tokens until accepted).
        self.spec_token_ids: list[int] = []
        self.kv_loaded = False  # a KV connector loaded blocks for it once (it is not asked again)
        self.num_cached_tokens = -1  # prefix-cache hit at first scheduling; -1 until then
        self.num_preemptions = 0
        # Prompt logprobs gathered chunk by chunk, sent with the request's first output.
        self.prompt_logprobs: list = []
        self.prompt_logprobs_sent = False
        self.max_tokens = self._max_tokens(max_model_len)
        # Timestamps (time.monotonic()), turned into metrics by the frontend.
        self.received_time = time.monotonic()  # by this engine's clock (arrival_time is the frontend's)
        self.trace_context = req.trace_context
        # Blocks a KV connector brought in (offload tiers, a prefill worker), and when a background load
        # of them began and ended: what a trace shows of it.
        self.kv_external_blocks = 0
        self.kv_load_times: tuple[float, float | None] | None = None
        self.first_scheduled_time: float | None = None
        self.first_token_time: float | None = None
        self.token_times: list[float] = []
        self.finished_time: float | None = None

    def _max_tokens(self, max_model_len: int) -> int:
        room = max_model_len - len(self.prompt_token_ids)
        return room if self.params.max_tokens is None else min(self.params.max_tokens, room)

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def is_finished(self) -> bool:
        return self.status == RequestStatus.FINISHED

    def append_token(self, token: int, now: float) -> None:
        self.output_token_ids.append(token)
        self.all_token_ids.append(token)
        if self.first_token_time is None:
            self.first_token_time = now
        self.token_times.append(now)

    def check_stop(self) -> FinishReason | None:
        """After a new token: should the request end? (Stop strings need text: the frontend checks those.)"""
        n_out = len(self.output_token_ids)
        last = self.output_token_ids[-1]
        # A grammar lets EOS and stop ids through only once its output is complete, and then nothing
        # else: a constrained request ends there, whatever min_tokens and ignore_eos say.
        constrained = self.params.structured is not None
        if n_out >= self.params.min_tokens or constrained:
            if (not self.params.ignore_eos or constrained) and last in self.eos_token_ids:
                self.stop_token = last
                return FinishReason.STOP
            if last in self.params.stop_token_ids:
                self.stop_token = last
                return FinishReason.STOP
            for seq in self.params.stop_token_sequences:  # (kept in the output: no stop_token)
                if seq[-1] == last and n_out >= len(seq) and self.output_token_ids[-len(seq) :] == seq:
                    return FinishReason.STOP
        if n_out >= self.max_tokens:
            return FinishReason.LENGTH
        return None

    def sort_key(self) -> tuple[int, float]:
        return (self.priority, self.arrival_time)
