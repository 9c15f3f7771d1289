"""Frontend side of generation: token ids to text, stop strings, and n > 1 sequences per request.

Runs outside the engine core (in the offline LLM's loop, or in the server process), so that the
engine loop only ever deals with token ids.
"""

from __future__ import annotations

import dataclasses
import sys
from array import array

from tokenmill.engine.protocol import EngineCoreOutput, FinishReason
from tokenmill.outputs import CompletionOutput, RequestMetrics, RequestOutput
from tokenmill.sampling_params import SamplingParams
from tokenmill.tokenizer.detokenizer import IncrementalDetokenizer
from tokenmill.tokenizer.tokenizer import Tokenizer


class SequenceState:
    """One generated sequence (a child of a request when n > 1)."""

    def __init__(
        self, index: int, prompt_ids: list[int], params: SamplingParams, tokenizer: Tokenizer, arrival: float
    ) -> None:
        self.index = index
        self.params = params
        self.detok = IncrementalDetokenizer(tokenizer, prompt_ids, params.skip_special_tokens)
        self.token_ids: list[int] = []
        self.logprobs = [] if params.logprobs is not None else None
        self.text = ""
        self.sent_text_len = 0
        self.sent_tokens = 0
        self.finish_reason: str | None = None
        self.stop_reason: str | int | None = None
        self.metrics = RequestMetrics(arrival_time=arrival)
        self.num_cached_tokens = 0
        self.embedding: list[float] | None = None
        self.prompt_logprobs: list | None = None
        self.kv_transfer: dict | None = None
        # Stop strings do not apply to constrained output: it ends where its grammar is complete (or at
        # max_tokens), never cut in the middle of a document by a string that occurs inside it.
        self.stops = [] if params.structured is not None else params.stop
        # Text that could still become a stop string is held back from streamed deltas.
        self.holdback = max((len(s) for s in self.stops), default=1) - 1

    def update(self, out: EngineCoreOutput) -> bool:
        """Apply an engine output; True if a stop string ended the sequence here."""
        self.token_ids.extend(out.new_token_ids)
        if out.kv_transfer is not None:
            self.kv_transfer = out.kv_transfer
        if self.logprobs is not None and out.new_logprobs:
            self.logprobs.extend(out.new_logprobs)
        m = self.metrics
        m.first_scheduled_time = out.first_scheduled_time
        m.first_token_time = out.first_token_time
        m.finished_time = out.finished_time
        m.token_times.extend(out.new_token_times)
        m.num_preemptions = out.num_preemptions
        self.num_cached_tokens = out.num_cached_tokens
        if out.prompt_logprobs is not None:
            self.prompt_logprobs = [None, *out.prompt_logprobs]
        if out.pooled is not None:  # float32 little-endian bytes; array, not numpy: the frontend stays light
            vector = array("f", out.pooled)
            if sys.byteorder == "big":
                vector.byteswap()
            self.embedding = vector.tolist()
        prev_len = len(self.text)
        shown = out.new_token_ids
        if out.stop_token is not None and not self.params.include_stop_str_in_output:
            # Ended by EOS or one of its stop_token_ids: the token stays in token_ids, its text does not
            # join the output (as vLLM does), or ` "` ending a JSON document would follow the document.
            shown = shown[:-1]
        self.text += self.detok.add_tokens(shown)
        if out.finish_reason is not None:
            # No more tokens will come: release text held back for an incomplete character.
            self.text += self.detok.flush()
        hit = bool(self.stops) and self._check_stop_strings(prev_len)
        if out.finish_reason is not None and not hit:
            self.finish_reason = out.finish_reason.value
            self.stop_reason = out.stop_token
        # The engine must be told only if it still runs the sequence.
        return hit and out.finish_reason is None

    def _check_stop_strings(self, prev_len: int) -> bool:
        # Only the new text (plus an overlap for stop strings spanning tokens) can hold a new match.
        begin = max(0, prev_len - self.holdback)
        best: tuple[int, str] | None = None
        for s in self.stops:
            pos = self.text.find(s, begin)
            if pos >= 0 and (best is None or pos < best[0]):
                best = (pos, s)
        if best is None:
            return False
        pos, s = best
        self.text = self.text[: pos + len(s)] if self.params.include_stop_str_in_output else self.text[:pos]
        self.finish_reason = FinishReason.STOP.value
        self.stop_reason = s
        return True

    def to_output(self) -> CompletionOutput:
        finished = self.finish_reason is not None
        visible = len(self.text) if finished else max(self.sent_text_len, len(self.text) - self.holdback)
        delta_text = self.text[self.sent_text_len : visible]
        delta_ids = self.token_ids[self.sent_tokens :]
        self.sent_text_len, self.sent_tokens = visible, len(self.token_ids)
        return CompletionOutput(
            index=self.index,
            text=self.text,
            token_ids=list(self.token_ids),
            finish_reason=self.finish_reason,
            stop_reason=self.stop_reason,
            logprobs=self.logprobs,
            delta_text=delta_text,
            delta_token_ids=delta_ids,
            metrics=self.metrics,
            embedding=self.embedding,
        )


class RequestState:
    def __init__(self, request_id: str, prompt: str | None, prompt_ids: list[int], n: int) -> None:
        self.request_id = request_id
        self.prompt = prompt
        self.prompt_ids = prompt_ids
        self.sequences: list[SequenceState] = []
        self.n = n

    @property
    def finished(self) -> bool:
        return all(s.finish_reason is not None for s in self.sequences)

    def output(self) -> RequestOutput:
        return RequestOutput(
            request_id=self.request_id,
            prompt=self.prompt,
            prompt_token_ids=self.prompt_ids,
            outputs=[s.to_output() for s in self.sequences],
            num_cached_tokens=min((s.num_cached_tokens for s in self.sequences), default=0),
            prompt_logprobs=next((s.prompt_logprobs for s in self.sequences if s.prompt_logprobs), None),
            kv_transfer=next((s.kv_transfer for s in self.sequences if s.kv_transfer), None),
        )


def child_request_id(request_id: str, index: int, n: int) -> str:
    return request_id if n == 1 else f"{request_id}#{index}"


def child_params(params: SamplingParams, index: int) -> SamplingParams:
    """Each of n sequences samples on its own; with a seed, sequence i uses seed + i."""
    seed = None if params.seed is None else params.seed + index
    return dataclasses.replace(params, n=1, seed=seed)


class OutputProcessor:
    def __init__(self, tokenizer: Tokenizer) -> None:
        self.tokenizer = tokenizer
        self.requests: dict[str, RequestState] = {}
        self.child_to_parent: dict[str, tuple[str, int]] = {}

    def add_request(
        self,
        request_id: str,
        prompt: str | None,
        prompt_ids: list[int],
        params: SamplingParams,
        arrival: float,
    ) -> list[tuple[str, SamplingParams]]:
        """Register a request; return (engine request id, params) for each of its n sequences."""
        state = RequestState(request_id, prompt, prompt_ids, params.n)
        children = []
        for i in range(params.n):
            cp = child_params(params, i)
            state.sequences.append(SequenceState(i, prompt_ids, cp, self.tokenizer, arrival))
            cid = child_request_id(request_id, i, params.n)
            self.child_to_parent[cid] = (request_id, i)
            children.append((cid, cp))
        self.requests[request_id] = state
        return children

    def process(
        self, outputs: list[EngineCoreOutput], final_only: bool = False
    ) -> tuple[list[RequestOutput], list[str]]:
        """Returns updated request outputs (with `final_only`, only of requests that finished) and the
        engine ids of sequences a stop string ended."""
        touched: dict[str, RequestState] = {}
        stopped: list[str] = []
        for out in outputs:
            link = self.child_to_parent.get(out.request_id)
            if link is None:
                continue
            parent_id, index = link
            state = self.requests[parent_id]
            if state.sequences[index].update(out):
                stopped.append(out.request_id)
            touched[parent_id] = state
        results = []
        for rid, state in touched.items():
            if final_only and not state.finished:
                continue  # building an output copies every token so far: not at every step
            ro = state.output()
            results.append(ro)
            if ro.finished:
                self._drop(rid)
        return results, stopped

    def abort(self, request_id: str) -> list[str]:
        """Forget a request; return its engine ids (to abort in the engine)."""
        state = self.requests.get(request_id)
        if state is None:
            return []
        ids = [child_request_id(request_id, i, state.n) for i in range(state.n)]
        self._drop(request_id)
        return ids

    def _drop(self, request_id: str) -> None:
        state = self.requests.pop(request_id, None)
        if state is not None:
            for i in range(state.n):
                self.child_to_parent.pop(child_request_id(request_id, i, state.n), None)
