"""Suffix decoding: drafts from suffix tries over this request's own prompt and output and over the
outputs of recent requests. Agent loops and code edits repeat text across turns and requests, which a
prompt-only lookup cannot see (Suffix Decoding, arXiv 2411.04975)."""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence

from tokenmill.worker.spec_decode.proposer import ProposeInput, Proposer
from tokenmill.worker.spec_decode.suffix_tree import SuffixTrie


class SuffixProposer(Proposer):
    def __init__(self, depth: int, max_cached_requests: int, min_token_prob: float, spec_factor: float = 1.0):
        self.depth = depth
        self.min_token_prob = min_token_prob
        self.spec_factor = spec_factor
        self.global_trie = SuffixTrie(depth)  # outputs of finished requests
        self.max_cached = max_cached_requests
        self._cached: deque[list[int]] = deque()
        self._own: dict[str, tuple[SuffixTrie, int]] = {}  # request -> (trie of its context, tokens in it)

    def propose(self, batch: list[ProposeInput]) -> list[list[int]]:
        drafts = []
        for b in batch:
            trie, seen = self._own.get(b.request_id) or (SuffixTrie(self.depth), 0)
            trie.extend(0, b.context[seen:])
            self._own[b.request_id] = (trie, len(b.context))
            pattern = b.context[-self.depth :]
            best: tuple[list[int], float] = ([], 0.0)
            for t in (trie, self.global_trie):
                node, length = t.match(pattern)
                if node is None:
                    continue
                k = min(b.k, max(1, int(self.spec_factor * length)))
                cand = SuffixTrie.continue_from(node, k, self.min_token_prob)
                if cand[1] > best[1]:
                    best = cand
            drafts.append(best[0])
        return drafts

    def forget(self, request_ids: Sequence[str], outputs: dict[str, list[int]] | None = None) -> None:
        for rid in request_ids:
            self._own.pop(rid, None)
        if not outputs or not self.max_cached:
            return
        for rid in request_ids:
            out = outputs.get(rid)
            if not out:
                continue
            self.global_trie.extend(rid, out)
            self.global_trie.close(rid)
            self._cached.append(out)
            if len(self._cached) > self.max_cached:
                self.global_trie.remove(self._cached.popleft())
