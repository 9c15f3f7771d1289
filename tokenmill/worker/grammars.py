"""The grammars of a worker's structured-output requests: one matcher per request, the token bitmask
of each step (every position of a request's drafts included) and advancing on what was sampled.

The masks are filled on the sampling rank right before sampling. A request verifying drafts gets one
mask per position: its matcher walks the drafts tentatively and is rolled back, so a draft that
leaves the grammar is masked out at its position (rejected by the verifier) and nothing after it
counts."""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch

from tokenmill.structured import GrammarBackend, GrammarError, allocate_bitmask
from tokenmill.worker.request_state import CachedRequestState

if TYPE_CHECKING:
    from tokenmill.structured import GrammarMatcher
    from tokenmill.tokenizer.tokenizer import Tokenizer

log = logging.getLogger(__name__)


class RequestGrammars:
    def __init__(self, tokenizer: Tokenizer, vocab_size: int, max_rollback: int) -> None:
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.max_rollback = max_rollback
        self._backend: GrammarBackend | None = None
        self.matchers: dict[str, GrammarMatcher] = {}
        self.failed: dict[str, str] = {}  # request -> why its grammar could not be used

    def add(self, st: CachedRequestState) -> None:
        """A request arrives (or returns after a preemption: its output so far is replayed)."""
        spec = st.params.structured
        if spec is None:
            return
        try:
            if self._backend is None:
                self._backend = GrammarBackend(self.tokenizer, self.vocab_size)
            m = self._backend.matcher(spec, self.max_rollback, st.params.stop_token_ids)
        except GrammarError as e:  # the server checks grammars first: only direct engine users get here
            self.failed[st.request_id] = f"GrammarError: {e}"
            return
        for t in st.output_token_ids:
            if not m.accept(t):
                self.failed[st.request_id] = "the output so far does not fit its grammar"
                return
        self.matchers[st.request_id] = m

    def forget(self, request_ids: Sequence[str]) -> None:
        for rid in request_ids:
            self.matchers.pop(rid, None)
            self.failed.pop(rid, None)

    def bitmask(
        self, reqs: list[CachedRequestState], drafts: list[list[int]], vocab_size: int
    ) -> torch.Tensor | None:
        """One row per logits row (all tokens allowed for unconstrained requests); None when no request
        of the step is constrained."""
        if not any(r.request_id in self.matchers for r in reqs):
            return None
        rows = sum(1 + len(d) for d in drafts)
        mask = allocate_bitmask(rows, vocab_size)
        first = 0
        for r, d in zip(reqs, drafts, strict=True):
            m = self.matchers.get(r.request_id)
            if m is not None:
                walked = 0
                for j in range(len(d) + 1):
                    m.fill_bitmask(mask, first + j)
                    if j == len(d) or not m.accept(d[j]):
                        break
                    walked += 1
                if walked:
                    m.rollback(walked)
            first += 1 + len(d)
        return mask

    def advance(
        self, reqs: list[CachedRequestState], tokens: list[list[int]], errors: dict[str, str]
    ) -> tuple[dict[str, str], dict[str, str]]:
        """Move each matcher over the tokens its request kept. Returns the requests that must fail (id
        -> why), and of those the ones whose grammar is at fault (id -> why, in words for the client)."""
        failed: dict[str, str] = {}
        theirs: dict[str, str] = {}
        for r, new in zip(reqs, tokens, strict=True):
            rid = r.request_id
            if rid in self.failed:
                failed[rid] = self.failed[rid]
                continue
            m = self.matchers.get(rid)
            if m is None or rid in errors:
                continue
            for t in new:
                if m.is_terminated():
                    break  # the stop token ended the grammar; the scheduler ends the request
                if m.accept(t):
                    continue
                if m.dead_end():
                    # Nothing may follow, yet the output is incomplete (a rule with no finite text,
                    # past what the compile-time probe walks): only EOS was left to sample.
                    theirs[rid] = failed[rid] = (
                        f"structured output: after {m.num_accepted} tokens the "
                        "grammar allows no continuation (no finite text completes it from there)"
                    )
                else:
                    log.error("request %s sampled token %d that its grammar forbids", rid, t)
                    failed[rid] = "sampled a token its grammar forbids"
                break
        return failed, theirs
