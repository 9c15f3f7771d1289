"""Disaggregated prefill and decode across a fleet: which workers prefill, which decode, and when a
request's prompt is worth sending to a prefill worker (conditional disaggregation, as Dynamo and llm-d
decide it: a long enough uncached prompt, and prefill workers with room)."""

from __future__ import annotations

import re
from dataclasses import dataclass

_SPEC = re.compile(r"^\s*(\d+)\s*P\s*(\d+)\s*D\s*$", re.IGNORECASE)


@dataclass
class DisaggSettings:
    num_prefill: int
    num_decode: int
    # Prompts with fewer uncached tokens than this are prefilled where they decode: moving their
    # blocks would cost more than computing them.
    min_prefill_tokens: int = 512
    # Past this many prompts in flight on every prefill worker, new prompts are prefilled locally.
    max_prefill_inflight: int = 4
    # A prefill that takes longer than this is given up: the decode worker computes the prompt.
    prefill_timeout_s: float = 60.0

    @property
    def num_workers(self) -> int:
        return self.num_prefill + self.num_decode

    def roles(self) -> list[str]:
        """The role of each worker, by index: prefill workers first."""
        return ["prefill"] * self.num_prefill + ["decode"] * self.num_decode


def parse_disaggregate(spec: str) -> tuple[int, int]:
    """ "1P1D" -> (1, 1): prefill and decode worker counts."""
    m = _SPEC.match(spec)
    if m is None or int(m.group(1)) < 1 or int(m.group(2)) < 1:
        raise ValueError(f"--disaggregate takes NPMD with N, M >= 1 (e.g. 1P1D, 2P4D), got {spec!r}")
    return int(m.group(1)), int(m.group(2))
