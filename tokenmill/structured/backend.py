"""Compiles StructuredOutputs specs with llguidance for one tokenizer and hands out matchers.

llguidance was chosen by measurement (benchmarks/grammar_mask.py, numbers in its docstring): xgrammar
fills masks ~4x faster per token (2 against 9 us), but accepts JSON schemas with keywords it does not
enforce (`not`, `contains`, `if`/`then`, `uniqueItems`, unknown `format`s) and lets outputs that break
them through, where llguidance refuses the schema (a 400 the client can act on). llguidance also
speaks the Lark dialect the `grammar` kind documents, compiles cold ~3x faster, and has no
dependencies (xgrammar brings transformers and triton)."""

from __future__ import annotations

import json
import logging
import threading
from collections import OrderedDict
from collections.abc import Iterable
from typing import TYPE_CHECKING

import llguidance

from tokenmill.sampling_params import StructuredOutputs
from tokenmill.structured.errors import GrammarError, one_line
from tokenmill.structured.grammar_source import WHAT, grammar_of, spec_key

if TYPE_CHECKING:
    import torch

    from tokenmill.structured.matcher import GrammarMatcher
    from tokenmill.tokenizer.tokenizer import Tokenizer

log = logging.getLogger(__name__)

CACHE_SIZE = 256  # compiled grammars kept (least recently used dropped): a few MB at most for JSON schemas


class GrammarBackend:
    """One per tokenizer and model head. `vocab_size` is the model's logits width; ids at or past the
    tokenizer's size are never allowed. Thread-safe: the server may check specs from several threads."""

    def __init__(self, tokenizer: Tokenizer, vocab_size: int, cache_size: int = CACHE_SIZE) -> None:
        self.vocab_size = vocab_size
        # EOS: every id the engine stops on (eos_token_ids holds eos_token_id, generation_config's ids and
        # the chat template's turn-end token), so a finished grammar lets the model end its turn.
        eos = set(tokenizer.eos_token_ids) | set(tokenizer.generation_eos_ids)
        if tokenizer.eos_token_id is not None:
            eos.add(tokenizer.eos_token_id)
        self.eos_ids = frozenset(t for t in eos if 0 <= t < vocab_size)
        if not self.eos_ids:
            raise ValueError("the tokenizer has no end-of-sequence token within the vocabulary")
        # ~0.2 s for a 49k vocabulary (the token trie the masks are computed on): once per backend.
        self._tokenizer = llguidance.LLTokenizer(
            tokenizer.backend.to_str(), n_vocab=vocab_size, eos_token=sorted(self.eos_ids)
        )
        # Bytes in no token (rare control characters, UTF-8 lead bytes of the planes past U+3FFFF in a
        # byte-level BPE vocabulary): text that needs one cannot be written, and llguidance's mask can
        # then allow a token that it refuses once sampled. Specs that spell such text are refused.
        written = set()
        for t in range(tokenizer.vocab_size):
            written.update(self._tokenizer.decode_bytes([t]))
        self._unwritable = frozenset(range(256)) - written
        # Short messages, without the grammar's internals (they go back to HTTP clients).
        self._limits = llguidance.LLParserLimits(verbose_errors=False)
        # The matchers' row (a torch tensor), made for the first: a server that only checks specs (the
        # API process) never imports torch.
        self._eos_row: torch.Tensor | None = None
        self._cache: OrderedDict[tuple[str, str | tuple[str, ...]], llguidance.LLMatcher] = OrderedDict()
        self._cache_size = cache_size
        self._lock = threading.Lock()

    def check(self, spec: StructuredOutputs) -> None:
        """Compile the spec (or find it cached); GrammarError if it is invalid or cannot be enforced."""
        self._compiled(spec)

    def matcher(
        self, spec: StructuredOutputs, max_rollback: int = 0, stop_token_ids: Iterable[int] = ()
    ) -> GrammarMatcher:
        """A fresh matcher at the start of the spec's grammar; rollback() undoes up to `max_rollback`.
        `stop_token_ids` (the request's) end the output as EOS does: allowed only once it is complete."""
        from tokenmill.structured.matcher import GrammarMatcher

        inner = self._compiled(spec).deep_copy()
        if self._eos_row is None:  # the same row whichever thread makes it first
            self._eos_row = _eos_only_row(self.eos_ids, self.vocab_size)
        stops = frozenset(t for t in stop_token_ids if 0 <= t < self.vocab_size)
        return GrammarMatcher(inner, self.eos_ids, self._eos_row, self.vocab_size, max_rollback, stops)

    def _compiled(self, spec: StructuredOutputs) -> llguidance.LLMatcher:
        """A pristine matcher for the spec: the compiled form, copied for each request (copies share the
        lazily built lexer, so a repeated schema also skips the first masks' warm-up)."""
        key = spec_key(spec)
        with self._lock:
            template = self._cache.get(key)
            if template is not None:
                self._cache.move_to_end(key)
                return template
        template = self._compile(spec, key[0])  # outside the lock: compiling may take a while (no GIL)
        with self._lock:
            self._cache[key] = template
            self._cache.move_to_end(key)
            while len(self._cache) > self._cache_size:
                self._cache.popitem(last=False)
        return template

    def _compile(self, spec: StructuredOutputs, kind: str) -> llguidance.LLMatcher:
        ch = self._unwritable_char(spec, kind)
        if ch is not None:
            raise GrammarError(f"{WHAT[kind]}: U+{ord(ch):04X} is not in this model's vocabulary")
        try:
            grammar = grammar_of(spec)
            matcher = llguidance.LLMatcher(self._tokenizer, grammar, log_level=0, limits=self._limits)
        except GrammarError:
            raise
        except (ValueError, RecursionError) as e:
            # What the compiler chokes on beyond its own checks (schema text nested past Python's
            # recursion limit, lone surrogates it cannot encode) is still the spec's fault.
            detail = one_line(f"{type(e).__name__}: {e}")[:200]
            raise GrammarError(f"{WHAT[kind]}: cannot be compiled: {detail}") from None
        if matcher.is_error():
            # Positions in generated grammars (regex, choice, JSON) point at text the user never wrote.
            message = one_line(matcher.get_error(), drop_position=kind != "grammar")
            raise GrammarError(f"{WHAT[kind]}: {message}")
        for warning in matcher.get_grammar_warnings():
            log.debug("grammar warning (%s): %s", kind, warning)
        problem = _first_steps_problem(matcher.deep_copy(), self.eos_ids)
        if problem is not None:
            raise GrammarError(f"{WHAT[kind]}: {one_line(problem, drop_position=kind != 'grammar')}")
        return matcher

    def _unwritable_char(self, spec: StructuredOutputs, kind: str) -> str | None:
        """The first character of the spec's text that needs a byte no token has (None if all can be
        written). Over-strict for a character only offered as one alternative, which is a price worth
        paying for characters this rare."""
        if not self._unwritable or kind == "json_object":
            return None
        value = getattr(spec, kind)
        texts = value if kind == "choice" else [value]
        if kind == "json":
            try:  # escapes in the schema (\u0014) are characters the output must spell
                texts = [json.dumps(json.loads(value), ensure_ascii=False)]
            except (ValueError, RecursionError):
                return None  # compiling reports it
        for text in texts:
            for ch in text if isinstance(text, str) else ():
                if ord(ch) < 0x80 and (ord(ch) not in self._unwritable or kind == "json"):
                    continue  # JSON strings spell control characters as \u escapes
                if not self._unwritable.isdisjoint(ch.encode("utf-8", "surrogatepass")):
                    return ch
        return None


PROBE_STEPS = 2  # tokens walked at the door: llguidance's limits (row items, lexer items) trip by then


def _first_steps_problem(m: llguidance.LLMatcher, eos: frozenset[int]) -> str | None:
    """Why the grammar cannot give output, found by walking its first tokens (each step the first token
    the mask allows), or None. A grammar with no finite derivation (`start: a`, `a: a`) fails its first
    mask; mutually recursive `$ref`s without a way out, and `anyOf` past llguidance's row limit, fail
    at the second. Found here they are a 400 at the door; in the engine they ended requests with a 500."""
    no_output = "it admits no output (no finite text satisfies it)"
    for _ in range(PROBE_STEPS):
        mask = m.compute_bitmask()
        if m.is_error():
            error = m.get_error()
            return no_output if not error or "NoExtensionBias" in error else error
        if m.is_accepting():
            return None
        token = next(
            (
                i * 8 + b
                for i, byte in enumerate(mask)
                if byte
                for b in range(8)
                if byte >> b & 1 and i * 8 + b not in eos
            ),
            None,
        )
        if token is None:
            return no_output
        m.consume_token(token)
        if m.is_error():
            return m.get_error() or "the grammar engine gave up on it"
    return None


def _eos_only_row(eos: frozenset[int], vocab_size: int) -> torch.Tensor:
    import torch

    words = [0] * ((vocab_size + 31) // 32)
    for t in eos:
        words[t // 32] |= 1 << (t % 32)
    # int32 words: bit 31 is the sign bit.
    return torch.tensor([w - (1 << 32) if w >= 1 << 31 else w for w in words], dtype=torch.int32)
