"""The worker's side of speculative decoding: after sampling, learn how the last drafts fared and ask
the proposer for the next ones."""

from __future__ import annotations

import time
from collections.abc import Sequence

from tokenmill.config import SpeculativeConfig
from tokenmill.worker.request_state import CachedRequestState
from tokenmill.worker.spec_decode.draft_cost import DraftCost
from tokenmill.worker.spec_decode.draft_length import DraftLength
from tokenmill.worker.spec_decode.proposer import ProposeInput, Proposer
from tokenmill.worker.step import ModelRunnerOutput

# Tokens a draft model may be behind a request and still guess for it (accepted guesses and the
# target's token after a step of drafting: at most 33).
MAX_CATCH_UP = 40


class Speculator:
    def __init__(self, config: SpeculativeConfig, proposer: Proposer) -> None:
        self.config = config
        self.proposer = proposer
        self.lengths = DraftLength(config.num_speculative_tokens, config.max_batch_tokens)
        # Guesses that cost a pass each (a draft model) are weighed against the target's steps.
        self.costs = DraftCost() if proposer.costly else None
        self._drafted: set[str] = set()  # requests given drafts at the last step
        self._draft_seconds = 0.0  # the draft passes of the last step
        self._last_drafted = False
        self._last_clean = False  # every request drafting then had drafted the step before too

    def propose(
        self,
        sampled: list[CachedRequestState],
        output: ModelRunnerOutput,
        drafts: list[list[int]],
        step_seconds: float | None = None,
    ) -> dict[str, list[int]]:
        """`step_seconds`: how long the target's step took (what a draft model's passes are weighed
        against)."""
        n = len(sampled)
        for st, new, draft in zip(sampled, output.sampled_token_ids, drafts, strict=True):
            if new:  # (empty: the request failed) how the drafts it verified fared, drafting on or off
                self.lengths.observe(st.request_id, len(draft), len(new) - 1)
        cost: float | None = 0.0
        if self.costs is not None:
            # What this step emitted, and what it took: its target step, and the draft passes that
            # proposed what it verified.
            # (Not after a pass that first read prompts or missed tokens: that is a cost of the
            # requests, or of switching on, not of drafting.)
            emitted = sum(len(t) for t in output.sampled_token_ids)
            if step_seconds and (self._last_clean or not self._last_drafted):
                self.costs.observe_tokens(n, self._last_drafted, step_seconds + self._draft_seconds, emitted)
            self._draft_seconds, self._last_drafted, self._last_clean = 0.0, False, False
            if not self.costs.drafting_pays(n):
                self._drafted = set()
                return {}
            cost = self.costs.share(n)
        cap = self.lengths.cap(n)
        batch = []
        for st, new in zip(sampled, output.sampled_token_ids, strict=True):
            if not new:
                continue
            k = self.lengths.length(st.request_id, cap, cost)
            if k and st.params.speculative and self._in_step(st, len(new)):
                batch.append(
                    ProposeInput(st.request_id, [*st.all_token_ids, *new], len(st.prompt_token_ids), k)
                )
        drafted_before, self._drafted = self._drafted, {b.request_id for b in batch}
        if not batch:
            return {}
        t0 = time.perf_counter()
        guesses = self.proposer.propose(batch)
        if self.costs is not None:
            self._draft_seconds = time.perf_counter() - t0
            self._last_drafted = any(guesses)
            self._last_clean = self._drafted <= drafted_before
            if step_seconds and self._last_clean:
                passes = max(len(g) for g in guesses)
                self.costs.observe(n, self._draft_seconds, passes, step_seconds)
        return {b.request_id: g for b, g in zip(batch, guesses, strict=True) if g}

    def _in_step(self, st: CachedRequestState, new: int) -> bool:
        """Whether a draft model may guess for this request now: it has read the request up to the
        last few tokens, or the request just started (its prompt must be read once). A request left
        behind while drafting did not pay (a large batch) stays without drafts: catching it up is a
        prefill of everything it missed, which cost more than it saved when the batch shrank."""
        if self.costs is None:
            return True
        held = self.proposer.held(st.request_id)
        if held is None:
            return not st.output_token_ids  # its first token is being sampled now
        return len(st.all_token_ids) + new - held <= MAX_CATCH_UP

    def forget(self, request_ids: Sequence[str], outputs: dict[str, list[int]] | None) -> None:
        self.proposer.forget(request_ids, outputs)
        if outputs is not None:
            self.lengths.forget(request_ids)


def make_speculator(config: SpeculativeConfig, draft: Proposer | None = None) -> Speculator | None:
    """The speculator for the config; `draft` is the DraftModelProposer the worker built for
    `draft:MODEL` (it needs the worker's model loading and cache sizing)."""
    if config.method is None:
        return None
    if draft is not None:
        return Speculator(config, draft)
    kind = config.method.split(":", 1)[0]
    if kind == "ngram":
        from tokenmill.worker.spec_decode.ngram import NgramProposer

        return Speculator(config, NgramProposer(config.prompt_lookup_min, config.prompt_lookup_max))
    if kind == "suffix":
        from tokenmill.worker.spec_decode.suffix import SuffixProposer

        proposer = SuffixProposer(
            config.suffix_max_tree_depth, config.suffix_max_cached_requests, config.suffix_min_token_prob
        )
        return Speculator(config, proposer)
    raise ValueError(f"speculative method {config.method!r} is not available in this worker")
