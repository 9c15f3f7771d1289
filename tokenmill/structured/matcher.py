"""One request's grammar state: the next-token mask, advancing, checking drafts, undoing drafts.

End of sequence is handled here rather than by llguidance: EOS is accepted exactly when the grammar is
complete (`is_accepting`), and never reaches the engine's matcher. The engine treats EOS differently
depending on whether the grammar can still grow (it does not count it for rollback, and does not
validate it, once nothing else may follow), so keeping it out gives one rule for accept, validate and
rollback alike.

A request's own `stop_token_ids` end it as EOS does (the scheduler stops on them), so they are end tokens
here too: masked until the grammar is complete and never consumed as text. Otherwise a stop id that is
also grammar text (`",` in a JSON array) would end the request in the middle of its document."""

from __future__ import annotations

import llguidance
import llguidance.torch
import torch


class GrammarMatcher:
    """Made by GrammarBackend.matcher(); lives in the worker, one per request."""

    def __init__(
        self,
        inner: llguidance.LLMatcher,
        eos: frozenset[int],
        eos_row: torch.Tensor,
        vocab_size: int,
        max_rollback: int,
        stop_ids: frozenset[int] = frozenset(),
    ) -> None:
        self._inner = inner
        self._eos = eos | stop_ids
        # Stop ids llguidance does not know as EOS: its mask treats them as text, fill_bitmask fixes them.
        self._stop_only = sorted(stop_ids - eos)
        self._eos_row = eos_row  # a bitmask row allowing only EOS, for after termination
        self._vocab_size = vocab_size
        self._max_rollback = max_rollback
        self._accepted = 0  # tokens accepted so far, EOS included
        self._eos_at: int | None = None  # position of the accepted EOS, if any

    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        """Write the tokens allowed at the next position into row `row` of a CPU bitmask from
        allocate_bitmask(rows, vocab_size). Once terminated, only EOS is allowed."""
        if bitmask.shape[1] != self._eos_row.shape[0]:
            raise ValueError(
                f"bitmask has {bitmask.shape[1]} words per row; vocab size {self._vocab_size} needs "
                f"{self._eos_row.shape[0]}"
            )
        if self._eos_at is not None:
            bitmask[row].copy_(self._eos_row)
            return
        llguidance.torch.fill_next_token_bitmask(self._inner, bitmask, row)
        if self._stop_only:
            complete = self._inner.is_accepting()
            words = bitmask[row]
            for t in self._stop_only:
                w = int(words[t >> 5]) & 0xFFFFFFFF
                w = w | (1 << (t & 31)) if complete else w & ~(1 << (t & 31))
                words[t >> 5] = w - (1 << 32) if w >= 1 << 31 else w  # int32 words: bit 31 is the sign

    def accept(self, token: int) -> bool:
        """Advance over `token`; False (state unchanged) if the grammar does not allow it here."""
        if self._eos_at is not None or not 0 <= token < self._vocab_size:
            return False
        if token in self._eos:
            if not self._inner.is_accepting():
                return False
            self._eos_at = self._accepted
        # try_consume leaves the matcher as it was on a bad token (consume_token would poison it).
        elif self._inner.try_consume_tokens([token]) != 1:
            return False
        self._accepted += 1
        return True

    def validate(self, tokens: list[int]) -> int:
        """How many leading tokens would be accepted one after another; the state does not change."""
        if self._eos_at is not None:
            return 0
        end = next(
            (i for i, t in enumerate(tokens) if t in self._eos or not 0 <= t < self._vocab_size), len(tokens)
        )
        body = list(tokens[:end])
        n = self._inner.validate_tokens(body) if body else 0
        if n < end or end == len(tokens) or tokens[end] not in self._eos:
            return n
        # tokens[end] is EOS: accepted only if the grammar is complete after the body.
        if body and self._inner.try_consume_tokens(body) != len(body):
            raise RuntimeError(f"grammar engine disagrees with its own validation: {self._inner.get_error()}")
        complete = self._inner.is_accepting()
        if body:
            self._inner.rollback(len(body))
        return n + 1 if complete else n

    def rollback(self, n: int) -> None:
        """Undo the last `n` accepted tokens (at most max_rollback, and no more than were accepted)."""
        if not 0 <= n <= min(self._max_rollback, self._accepted):
            raise ValueError(
                f"cannot roll back {n} tokens: {self._accepted} accepted, max_rollback {self._max_rollback}"
            )
        if n == 0:
            return
        inner_n = n
        if self._eos_at is not None:  # EOS is always the last accepted token and the engine never saw it
            self._eos_at = None
            inner_n -= 1
        if inner_n and not self._inner.rollback(inner_n):
            raise RuntimeError(f"grammar rollback failed: {self._inner.get_error()}")
        self._accepted -= n

    @property
    def num_accepted(self) -> int:
        """Tokens of output the grammar has accepted (EOS included)."""
        return self._accepted

    def dead_end(self) -> bool:
        """The grammar allows nothing next although it is not complete (llguidance has given up)."""
        return self._inner.is_error()

    def is_terminated(self) -> bool:
        """True once an EOS (or stop) token was accepted (the grammar was complete)."""
        return self._eos_at is not None
