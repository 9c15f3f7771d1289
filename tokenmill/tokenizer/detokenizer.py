"""Streaming detokenization: turning generated token ids into text deltas, one step at a time.

Decoding each token alone is wrong (a token can be half of a UTF-8 character, and SentencePiece
decoders treat a word's first token differently), and re-decoding everything each step is O(n).
So we keep two offsets into the token list: text up to `read_offset` has been emitted, and the
tokens from `prefix_offset` to `read_offset` are a small window of already-emitted context. Each step
decodes the window with and without the new tokens and emits the difference.
"""

from __future__ import annotations

from collections.abc import Sequence

from tokenmill.tokenizer.tokenizer import Tokenizer

# How many prompt tokens to use as the first window: enough context for decoders that look at a
# token's neighbours (leading-space handling, byte fallback), small enough to be cheap.
_PROMPT_CONTEXT_TOKENS = 5
_REPLACEMENT_CHAR = "\ufffd"


class IncrementalDetokenizer:
    """Text deltas for a stream of generated token ids, never splitting a UTF-8 character.

    When the decoded window ends in U+FFFD (an incomplete multi-byte sequence), the text is held
    back until a later token completes it; `flush()` releases whatever is still held at the end.
    """

    def __init__(
        self, tokenizer: Tokenizer, prompt_token_ids: Sequence[int], skip_special_tokens: bool = True
    ) -> None:
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self._ids: list[int] = list(prompt_token_ids)
        self._prompt_len = len(self._ids)
        self._prefix_offset = max(len(self._ids) - _PROMPT_CONTEXT_TOKENS, 0)
        self._read_offset = len(self._ids)
        self._pieces: list[str] = []

    @property
    def token_ids(self) -> list[int]:
        """The output token ids added so far (without the prompt)."""
        return self._ids[self._prompt_len :]

    @property
    def text(self) -> str:
        """All text emitted so far (the concatenation of the deltas)."""
        return "".join(self._pieces)

    def add_tokens(self, new_ids: Sequence[int]) -> str:
        """Append generated ids; return the text they complete (possibly "")."""
        self._ids.extend(new_ids)
        return self._emit(hold_incomplete=True)

    def flush(self) -> str:
        """Release text held back for an incomplete character (as U+FFFD); call at end of stream."""
        return self._emit(hold_incomplete=False)

    def _emit(self, hold_incomplete: bool) -> str:
        decode = self.tokenizer.decode
        skip = self.skip_special_tokens
        before = decode(self._ids[self._prefix_offset : self._read_offset], skip_special_tokens=skip)
        after = decode(self._ids[self._prefix_offset :], skip_special_tokens=skip)
        # Shorter or equal: nothing new yet (e.g. a skipped special token). Keep the offsets so the
        # next tokens are decoded together with these ones.
        if len(after) <= len(before) or (hold_incomplete and after.endswith(_REPLACEMENT_CHAR)):
            return ""
        delta = after[len(before) :]
        self._prefix_offset = self._read_offset
        self._read_offset = len(self._ids)
        self._pieces.append(delta)
        return delta
