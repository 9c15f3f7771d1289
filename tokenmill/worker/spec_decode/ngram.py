"""Prompt lookup (n-gram) proposer: find the context's last n tokens earlier in the context and propose
what followed them there. Copying tasks (summaries, extraction, code edits) repeat the input, so the
longest match is often a long run of correct tokens at no model cost."""

from __future__ import annotations

import numpy as np

from tokenmill.worker.spec_decode.proposer import ProposeInput, Proposer


def ngram_lookup(context: np.ndarray, n_min: int, n_max: int, k: int) -> list[int]:
    """The tokens after the earliest earlier occurrence of the longest suffix of `context` of length
    n_max down to n_min, at most k of them; [] when no suffix of those lengths occurs before."""
    length = len(context)
    for n in range(min(n_max, length - 1), n_min - 1, -1):
        pattern = context[length - n :]
        # Candidate starts: every window that ends before the suffix itself (so it has a follower).
        windows = np.lib.stride_tricks.sliding_window_view(context[: length - 1], n)
        hits = np.flatnonzero((windows == pattern).all(axis=1))
        if hits.size:
            start = int(hits[0]) + n
            return context[start : start + k].tolist()
    return []


class NgramProposer(Proposer):
    def __init__(self, n_min: int, n_max: int) -> None:
        self.n_min, self.n_max = n_min, n_max

    def propose(self, batch: list[ProposeInput]) -> list[list[int]]:
        return [
            ngram_lookup(np.asarray(b.context, dtype=np.int64), self.n_min, self.n_max, b.k) for b in batch
        ]
