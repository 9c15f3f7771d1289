"""Whether a draft model pays at the batch size in hand, measured, and what one guess costs.

A guess from a draft model costs a draft pass, and both passes grow with the batch at different rates
(a 4-bit draft is cheap for a few rows and dear past them, and verifying rows stops being free once
the target's step is no longer bound by reading its weights). Rather than model all that, the time
per emitted token is measured both ways, per batch-size bucket (1, 2-3, 4-7, 8-15, ...): steps after
a step with drafts count for "on" (the target's step plus the draft passes before it), steps after
one without for "off". The better way is used; the other is tried again now and then, since the text
and the machine change.

The share of a target step one guess costs (the draft's time per pass over the same step's time) sets
how many tokens each request guesses when drafting is on. It is sampled only when every drafting
request also drafted the step before: otherwise the draft first reads what it missed (a prompt, or
the tokens of steps without drafts), a cost of switching on, which the on/off timing counts instead.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class _Bucket:
    share: float | None = None  # one guess's draft pass / the target step
    on: float | None = None  # seconds per emitted token with drafts (decayed mean)
    off: float | None = None  # seconds per emitted token without
    steps: int = 0
    on_samples: int = 0
    off_samples: int = 0


class DraftCost:
    DECAY = 0.5
    TOKEN_DECAY = 0.9
    EXPLORE_EVERY = 64  # steps of a bucket between tries of the way that measured worse
    FIRST_SAMPLES = 4  # of each way, before the first decision

    def __init__(self) -> None:
        self._buckets: dict[int, _Bucket] = {}

    @staticmethod
    def bucket(batch_size: int) -> int:
        return max(batch_size, 1).bit_length()

    def _get(self, batch_size: int) -> _Bucket:
        return self._buckets.setdefault(self.bucket(batch_size), _Bucket())

    def observe(self, batch_size: int, draft_seconds: float, passes: int, step_seconds: float) -> None:
        """A clean sample of what one guess costs next to the target's step."""
        if passes <= 0 or step_seconds <= 0:
            return
        b = self._get(batch_size)
        sample = draft_seconds / passes / step_seconds
        b.share = sample if b.share is None else self.DECAY * b.share + (1 - self.DECAY) * sample

    def observe_tokens(self, batch_size: int, drafted: bool, seconds: float, tokens: int) -> None:
        """A step emitted `tokens` in `seconds` (its target step, plus the draft passes that proposed
        what it verified when `drafted`)."""
        if tokens <= 0 or seconds <= 0:
            return
        b = self._get(batch_size)
        value = seconds / tokens
        last = b.on if drafted else b.off
        mean = value if last is None else self.TOKEN_DECAY * last + (1 - self.TOKEN_DECAY) * value
        if drafted:
            b.on, b.on_samples = mean, b.on_samples + 1
        else:
            b.off, b.off_samples = mean, b.off_samples + 1

    def share(self, batch_size: int) -> float | None:
        """One guess's cost as a share of a target step at this batch size; None until measured."""
        return self._get(batch_size).share

    def drafting_pays(self, batch_size: int) -> bool:
        """Whether to draft at this step: the way measured faster for this batch size, the other
        every EXPLORE_EVERY steps, and each way for a few steps before deciding (one step's time is
        noisy)."""
        b = self._get(batch_size)
        b.steps += 1
        if b.on_samples < self.FIRST_SAMPLES:
            return True
        if b.off_samples < self.FIRST_SAMPLES:
            return False
        assert b.on is not None and b.off is not None
        better = b.on < b.off
        return better != (b.steps % self.EXPLORE_EVERY == 0)
