"""The structured-output grammar layer on the embedded model's real tokenizer, checked against
references: token walks of known-valid texts, `json.loads` + `jsonschema` / `re.fullmatch` / the choice
list on random walks through the masks, and a plain loop for apply_bitmask."""

from __future__ import annotations

import json
import random
import re
from pathlib import Path

import jsonschema
import numpy as np
import pytest
import torch

from tokenmill.sampling_params import StructuredOutputs
from tokenmill.structured import (
    GrammarBackend,
    GrammarError,
    GrammarMatcher,
    allocate_bitmask,
    apply_bitmask,
)
from tokenmill.tokenizer.tokenizer import Tokenizer
from tokenmill.weights.tokenizer_source import load_tokenizer

EXTRA_IDS = 64  # a model head wider than the tokenizer: these ids must never be allowed

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "address": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "minLength": 1, "maxLength": 10},
                "zip": {"type": "string", "pattern": "^[0-9]{5}$"},
            },
            "required": ["city", "zip"],
            "additionalProperties": False,
        },
    },
    "required": ["name", "age", "address"],
    "additionalProperties": False,
}
ORDER = {
    "type": "object",
    "properties": {
        "items": {
            "type": "array",
            "minItems": 1,
            "maxItems": 3,
            "items": {
                "type": "object",
                "properties": {
                    "sku": {"type": "string", "maxLength": 6},
                    "qty": {"type": "integer", "minimum": 1, "maximum": 99},
                },
                "required": ["sku", "qty"],
                "additionalProperties": False,
            },
        },
        "express": {"type": "boolean"},
    },
    "required": ["items", "express"],
    "additionalProperties": False,
}
PRODUCT = {
    "type": "object",
    "properties": {
        "color": {"enum": ["red", "green", "blue"]},
        "size": {"type": "string", "enum": ["S", "M", "L", "XL"]},
        "price": {"type": "number", "minimum": 0, "maximum": 1000},
        "rating": {"type": "integer", "minimum": 1, "maximum": 5},
    },
    "required": ["color", "size", "price", "rating"],
    "additionalProperties": False,
}
OPTIONAL = {  # only "title" is required
    "type": "object",
    "properties": {
        "title": {"type": "string", "maxLength": 8},
        "year": {"type": "integer", "minimum": 1900, "maximum": 2100},
        "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}, "maxItems": 3},
        "draft": {"type": "boolean"},
    },
    "required": ["title"],
    "additionalProperties": False,
}
SCHEMAS = {"person": PERSON, "order": ORDER, "product": PRODUCT, "optional": OPTIONAL}
INSTANCES = {
    "person": {"name": "Ada", "age": 36, "address": {"city": "London", "zip": "12345"}},
    "order": {"items": [{"sku": "A-17", "qty": 2}, {"sku": "B4", "qty": 10}], "express": False},
    "product": {"color": "green", "size": "XL", "price": 129.5, "rating": 4},
    "optional": {"title": "Caches", "tags": ["b", "a"]},
}
# [0-9], not \\d: the engine (Rust regex syntax) takes \\d as any Unicode digit, as Python does, but
# on a newer Unicode version than this Python knows.
REGEX = r"[A-Z][a-z]{2,5}-[0-9]{3}(x[0-9a-f]{1,2})?"
CHOICES = ["yes", "yes please", "no", "maybe later"]
LARK = 'start: greeting " " name "!"\ngreeting: "hello" | "hi"\nname: /[a-z]{1,6}/\n'
LARK_REFERENCE = r"(hello|hi) [a-z]{1,6}!"


@pytest.fixture(scope="module")
def tokenizer(model_path: Path) -> Tokenizer:
    return load_tokenizer(model_path, None)


@pytest.fixture(scope="module")
def backend(tokenizer: Tokenizer) -> GrammarBackend:
    return GrammarBackend(tokenizer, tokenizer.vocab_size + EXTRA_IDS)


def json_spec(schema: dict) -> StructuredOutputs:
    return StructuredOutputs(json=json.dumps(schema))


def allowed(m: GrammarMatcher, vocab: int) -> torch.Tensor:
    """The tokens the matcher allows next, as a bool vector, unpacked bit by bit (independent of
    apply_bitmask)."""
    bitmask = allocate_bitmask(1, vocab)
    m.fill_bitmask(bitmask, 0)
    # numpy, one thread: torch's small ops wait on a busy second core when other jobs run.
    bits = np.unpackbits(bitmask[0].numpy().view(np.uint8), bitorder="little")[:vocab]
    return torch.from_numpy(bits.astype(bool))


def eos_only(backend: GrammarBackend) -> torch.Tensor:
    want = torch.zeros(backend.vocab_size, dtype=torch.bool)
    want[sorted(backend.eos_ids)] = True
    return want


def walk_text(backend: GrammarBackend, m: GrammarMatcher, ids: list[int]) -> None:
    """Accept `ids` one by one, each allowed by the mask of its position, with EOS never allowed before
    the end; at the end only EOS is allowed, and accepting it terminates the matcher."""
    eos = sorted(backend.eos_ids)
    for i, t in enumerate(ids):
        mask = allowed(m, backend.vocab_size)
        assert mask[t], f"token {i} ({t}) of a valid text is masked out"
        assert not mask[eos].any(), f"EOS allowed after only {i} tokens of the text"
        assert m.accept(t)
    assert torch.equal(allowed(m, backend.vocab_size), eos_only(backend))
    assert not m.is_terminated()
    assert m.accept(eos[0])
    assert m.is_terminated()
    assert not m.accept(ids[0]) and not m.accept(eos[0])


def random_walk(backend: GrammarBackend, m: GrammarMatcher, rng: random.Random, limit: int) -> list[int]:
    """Tokens drawn uniformly among the allowed ones until EOS (excluded from the result)."""
    out: list[int] = []
    for _ in range(limit):
        ids = np.flatnonzero(allowed(m, backend.vocab_size).numpy()).tolist()
        assert ids, "a live matcher allows nothing"
        t = rng.choice(ids)
        assert m.accept(t)
        if t in backend.eos_ids:
            assert m.is_terminated()
            return out
        out.append(t)
    raise AssertionError(f"no EOS after {limit} tokens: {out}")


# --- walks of known-valid texts -----------------------------------------------------------------


@pytest.mark.parametrize("name", sorted(SCHEMAS))
def test_valid_instance_walks_through_the_masks(backend, tokenizer, name):
    text = json.dumps(INSTANCES[name])  # json.dumps' default layout is the one the grammar allows
    jsonschema.validate(INSTANCES[name], SCHEMAS[name])
    m = backend.matcher(json_spec(SCHEMAS[name]))
    walk_text(backend, m, tokenizer.encode(text, add_special_tokens=False))


def test_non_strict_schema_allows_other_properties(backend, tokenizer):
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    value = {"a": 1, "extra": [True, "x"]}
    jsonschema.validate(value, schema)
    m = backend.matcher(json_spec(schema))
    walk_text(backend, m, tokenizer.encode(json.dumps(value), add_special_tokens=False))
    strict = backend.matcher(json_spec({**schema, "additionalProperties": False}))
    ids = tokenizer.encode(json.dumps(value), add_special_tokens=False)
    assert strict.validate(ids) < len(ids)


def test_json_object_accepts_any_object_and_nothing_else(backend, tokenizer):
    spec = StructuredOutputs(json_object=True)
    value = {"a": [1, 2.5, None, True], "b": {"c": 'd\u00e9 \n\t"q" \\ \u0001'}, "e": ""}
    text = json.dumps(value, ensure_ascii=False)  # control characters escaped, the rest as it is
    walk_text(backend, backend.matcher(spec), tokenizer.encode(text, add_special_tokens=False))
    # \uXXXX for a printable character is refused: one spelling per string, no surrogate halves.
    escaped = tokenizer.encode(json.dumps(value), add_special_tokens=False)
    assert backend.matcher(spec).validate(escaped) < len(escaped)
    for not_object in ("[1, 2]", '"x"', "12"):
        ids = tokenizer.encode(not_object, add_special_tokens=False)
        assert backend.matcher(spec).validate(ids) < len(ids), not_object


def test_layout_is_json_dumps_default_without_free_whitespace(backend, tokenizer):
    m = backend.matcher(json_spec(PRODUCT))
    for text in (
        json.dumps(INSTANCES["product"], separators=(",", ":")),
        json.dumps(INSTANCES["product"], indent=2),
        json.dumps(INSTANCES["product"]) + " ",
    ):
        ids = tokenizer.encode(text, add_special_tokens=False)
        assert m.validate(ids) < len(ids), text


def test_invalid_continuation_is_masked_and_refused(backend, tokenizer):
    m = backend.matcher(json_spec(PERSON), max_rollback=4)
    prefix = tokenizer.encode('{"name": "Ada", "age": ', add_special_tokens=False)
    for t in prefix:
        assert m.accept(t)
    before = allowed(m, backend.vocab_size)
    for bad in ('"', "-", "]", "x", "{"):
        t = tokenizer.encode(bad, add_special_tokens=False)[0]
        assert not before[t], bad
        assert not m.accept(t), bad
    assert before[tokenizer.encode("1", add_special_tokens=False)[0]]
    assert torch.equal(allowed(m, backend.vocab_size), before), "a refused token changed the state"
    assert not m.accept(sorted(backend.eos_ids)[0]), "EOS accepted in the middle of an object"
    assert not m.accept(tokenizer.bos_token_id), "a special token accepted"


def test_ids_past_the_tokenizer_are_never_allowed(backend, tokenizer):
    m = backend.matcher(StructuredOutputs(json_object=True))
    mask = allowed(m, backend.vocab_size)
    assert mask[: tokenizer.vocab_size].any()
    assert not mask[tokenizer.vocab_size :].any()
    assert not m.accept(tokenizer.vocab_size) and not m.accept(backend.vocab_size) and not m.accept(-1)


# --- random walks against references --------------------------------------------------------------


@pytest.mark.parametrize("name", sorted(SCHEMAS))
def test_random_walks_give_schema_valid_json(backend, tokenizer, name):
    rng = random.Random(1234)
    for _ in range(25):
        ids = random_walk(backend, backend.matcher(json_spec(SCHEMAS[name])), rng, limit=400)
        text = tokenizer.decode(ids, skip_special_tokens=False)
        value = json.loads(text)
        jsonschema.validate(value, SCHEMAS[name])


def test_random_walks_fullmatch_the_regex(backend, tokenizer):
    rng = random.Random(7)
    spec = StructuredOutputs(regex=REGEX)
    for _ in range(50):
        text = tokenizer.decode(random_walk(backend, backend.matcher(spec), rng, limit=100))
        assert re.fullmatch(REGEX, text), text


def test_random_walks_end_on_a_choice(backend, tokenizer):
    rng = random.Random(3)
    spec = StructuredOutputs(choice=CHOICES)
    seen = set()
    for _ in range(40):
        text = tokenizer.decode(random_walk(backend, backend.matcher(spec), rng, limit=50))
        assert text in CHOICES, text
        seen.add(text)
    assert len(seen) >= 3
    # "yes" is complete and also the start of "yes please": EOS and the continuation are both allowed.
    m = backend.matcher(spec)
    for t in tokenizer.encode("yes", add_special_tokens=False):
        assert m.accept(t)
    assert m.validate([sorted(backend.eos_ids)[0]]) == 1
    assert m.validate(tokenizer.encode(" please", add_special_tokens=False)) >= 1


def test_random_walks_follow_the_lark_grammar(backend, tokenizer):
    rng = random.Random(11)
    spec = StructuredOutputs(grammar=LARK)
    for _ in range(20):
        text = tokenizer.decode(random_walk(backend, backend.matcher(spec), rng, limit=50))
        assert re.fullmatch(LARK_REFERENCE, text), text


# --- rollback and validate ---------------------------------------------------------------------


def test_rollback_restores_the_masks(backend, tokenizer):
    ids = tokenizer.encode(json.dumps(INSTANCES["order"]), add_special_tokens=False)
    eos = sorted(backend.eos_ids)[0]
    m = backend.matcher(json_spec(ORDER), max_rollback=len(ids) + 1)
    masks = [allowed(m, backend.vocab_size)]
    for t in ids:
        assert m.accept(t)
        masks.append(allowed(m, backend.vocab_size))
    assert m.accept(eos) and m.is_terminated()
    m.rollback(1)  # EOS undone: the grammar is back where it was, complete but not ended
    assert not m.is_terminated()
    assert torch.equal(allowed(m, backend.vocab_size), masks[-1])
    for n in (3, 1, 7):
        m.rollback(n)
        del masks[-n:]
        assert torch.equal(allowed(m, backend.vocab_size), masks[-1])
    m.rollback(len(masks) - 1)
    assert torch.equal(allowed(m, backend.vocab_size), masks[0])
    walk_text(backend, m, ids)  # and it walks the whole text again


def test_stop_token_ids_end_the_output_only_once_it_is_complete(backend, tokenizer):
    """A request's stop ids end it as EOS does (the scheduler stops on them): masked while the document is
    incomplete, even where the grammar would take them as text (`",` between two items), and allowed
    (with EOS) once it is complete, where accepting one ends the matcher."""
    schema = {"type": "array", "items": {"type": "string"}, "minItems": 2, "maxItems": 4}
    text = json.dumps(["apple", "pear", "fig"])
    stops = sorted(set(tokenizer.encode('", "', add_special_tokens=False)))
    head = tokenizer.encode('["apple', add_special_tokens=False)
    plain = backend.matcher(json_spec(schema))
    for t in head:
        assert plain.accept(t)
    assert allowed(plain, backend.vocab_size)[stops].any()  # without stop ids, they are text here
    # The text a character at a time, so that no stop id spells any of it.
    ids = [t for ch in text for t in tokenizer.encode(ch, add_special_tokens=False)]
    assert not set(ids) & set(stops)
    m = backend.matcher(json_spec(schema), stop_token_ids=[*stops, backend.vocab_size + 5])
    for i, t in enumerate(ids):
        mask = allowed(m, backend.vocab_size)
        assert mask[t], f"token {i} ({t}) of a valid text is masked out"
        assert not mask[stops].any(), f"a stop id allowed after {i} tokens of an incomplete document"
        if i == len('["apple'):  # where `plain` took them as text: refused here
            assert not m.accept(stops[0])
        assert m.accept(t)
    mask = allowed(m, backend.vocab_size)
    assert mask[stops].all() and mask[sorted(backend.eos_ids)].all()
    assert m.validate([stops[0]]) == 1 and m.validate([ids[0]]) == 0
    assert m.accept(stops[-1]) and m.is_terminated()


def test_rollback_is_bounded(backend, tokenizer):
    m = backend.matcher(StructuredOutputs(choice=CHOICES), max_rollback=1)
    with pytest.raises(ValueError):
        m.rollback(1)  # nothing accepted yet
    ids = tokenizer.encode("maybe later", add_special_tokens=False)
    assert len(ids) >= 2
    for t in ids:
        assert m.accept(t)
    with pytest.raises(ValueError):
        m.rollback(2)  # past max_rollback
    m.rollback(1)
    assert m.accept(ids[-1])


def test_validate_does_not_change_state(backend, tokenizer):
    ids = tokenizer.encode(json.dumps(INSTANCES["person"]), add_special_tokens=False)
    eos = sorted(backend.eos_ids)[0]
    m = backend.matcher(json_spec(PERSON))
    for t in ids[:3]:
        assert m.accept(t)
    before = allowed(m, backend.vocab_size)
    rest = ids[3:]
    bad = tokenizer.encode("]", add_special_tokens=False)[0]
    cases = [
        (rest, len(rest)),
        (rest + [eos], len(rest) + 1),
        (rest + [eos, eos], len(rest) + 1),  # nothing after EOS
        (rest[:5] + [eos], 5),  # EOS before the object closes
        (rest[:4] + [bad] + rest[4:], 4),
        (rest[:2] + [backend.vocab_size], 2),
        ([], 0),
    ]
    for tokens, want in cases:
        assert m.validate(tokens) == want, (tokens, want)
        assert torch.equal(allowed(m, backend.vocab_size), before)
        # the reference: a fresh matcher accepting one by one
        ref = backend.matcher(json_spec(PERSON))
        for t in ids[:3]:
            assert ref.accept(t)
        assert sum(1 for _ in _accepted_prefix(ref, tokens)) == want
    assert not m.is_terminated()
    walk_text(backend, m, rest)


def _accepted_prefix(m: GrammarMatcher, tokens: list[int]):
    for t in tokens:
        if not m.accept(t):
            return
        yield t


def test_validate_after_termination_is_zero(backend, tokenizer):
    m = backend.matcher(StructuredOutputs(choice=["no"]))
    ids = tokenizer.encode("no", add_special_tokens=False)
    eos = sorted(backend.eos_ids)[0]
    assert m.validate(ids + [eos]) == len(ids) + 1
    for t in ids + [eos]:
        assert m.accept(t)
    assert m.is_terminated() and m.validate([eos]) == 0
    assert torch.equal(allowed(m, backend.vocab_size), eos_only(backend))


# --- errors and the cache ------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("spec", "prefix"),
    [
        (StructuredOutputs(json="{bad json"), "invalid JSON schema: not valid JSON"),
        (StructuredOutputs(json="[1, 2]"), "invalid JSON schema: must be an object"),
        (StructuredOutputs(json='{"type": "strin"}'), "invalid JSON schema: "),
        (StructuredOutputs(json='{"not": {"type": "string"}}'), "invalid JSON schema: "),  # not enforceable
        (StructuredOutputs(json='{"type": "string", "format": "no-such-format"}'), "invalid JSON schema: "),
        (StructuredOutputs(json='{"$ref": "#/$defs/missing"}'), "invalid JSON schema: "),
        (StructuredOutputs(regex="[a-z"), "invalid regex: "),
        (StructuredOutputs(regex=r"(a)\1"), "invalid regex: "),
        (StructuredOutputs(grammar="start: undefined_rule"), "invalid grammar: "),
        (StructuredOutputs(grammar='start: "a" ('), "invalid grammar: "),
        (StructuredOutputs(grammar='start: %json {"type": "strin"}'), "invalid grammar: "),
        (StructuredOutputs(json="false"), "invalid JSON schema: "),
        # Past what the compiler's own checks catch: nesting beyond Python's recursion limit, a lone
        # surrogate that cannot be encoded.
        (StructuredOutputs(json='{"items": ' * 5000 + "{}" + "}" * 5000), "invalid JSON schema: "),
        (StructuredOutputs(regex="a\ud800"), "invalid regex: "),
        (StructuredOutputs(choice=["\ud800"]), "invalid choice: "),
        # Text that needs a byte no token of this vocabulary has (a rare control character, a character
        # past U+3FFFF): the mask could not be followed.
        (StructuredOutputs(choice=["+\U00095a76"]), "invalid choice: U+95A76 is not in this model's"),
        (StructuredOutputs(regex="a\x14"), "invalid regex: U+0014 is not in this model's"),
        (StructuredOutputs(json='{"const": "\U00095a76"}'), "invalid JSON schema: U+95A76 is not"),
    ],
)
def test_bad_specs_raise_one_line_grammar_errors(backend, spec, prefix):
    with pytest.raises(GrammarError) as info:
        backend.check(spec)
    message = str(info.value)
    assert message.startswith(prefix), message
    assert "\n" not in message and "Traceback" not in message and len(message) <= 300
    with pytest.raises(GrammarError):
        backend.matcher(spec)
    assert isinstance(info.value, ValueError)


def test_empty_choice_is_a_grammar_error(backend):
    spec = StructuredOutputs(choice=["a"])
    spec.choice = []  # plain data: it can be emptied after construction
    with pytest.raises(GrammarError, match="^invalid choice: "):
        backend.check(spec)


def test_wrongly_typed_fields_are_grammar_errors(backend):
    spec = StructuredOutputs(json="{}")
    spec.json = {"type": "object"}  # type: ignore[assignment]
    with pytest.raises(GrammarError, match="^invalid JSON schema: must be a string"):
        backend.check(spec)
    spec = StructuredOutputs(choice=["a"])
    spec.choice = ["a", 1]  # type: ignore[list-item]
    with pytest.raises(GrammarError, match="^invalid choice: "):
        backend.check(spec)


def test_messages_name_the_problem(backend):
    with pytest.raises(GrammarError, match="not"):
        backend.check(StructuredOutputs(json='{"not": {"type": "string"}}'))
    with pytest.raises(GrammarError, match="unclosed character class"):
        backend.check(StructuredOutputs(regex="[a-z"))
    with pytest.raises(GrammarError, match="undefined_rule"):
        backend.check(StructuredOutputs(grammar="start: undefined_rule"))


def test_good_specs_check(backend):
    for spec in (
        json_spec(PERSON),
        StructuredOutputs(json="true"),
        StructuredOutputs(json='{"type": "object", "properties": {"a": {"type": "string"}}}'),
        StructuredOutputs(json_object=True),
        StructuredOutputs(regex=REGEX),
        StructuredOutputs(choice=['say "hi"', "caf\u00e9", "back\\slash"]),
        StructuredOutputs(grammar=LARK),
    ):
        backend.check(spec)


def test_compiled_grammars_are_cached_and_bounded(tokenizer, monkeypatch):
    small = GrammarBackend(tokenizer, tokenizer.vocab_size, cache_size=2)
    compiles: list[str] = []
    real = small._compile

    def counting(spec, kind):
        compiles.append(kind)
        return real(spec, kind)

    monkeypatch.setattr(small, "_compile", counting)
    a, b, c = json_spec(PERSON), StructuredOutputs(regex=REGEX), StructuredOutputs(choice=CHOICES)
    small.check(a)
    small.check(StructuredOutputs(json=json.dumps(PERSON)))  # an equal spec, another object
    small.matcher(a)
    assert compiles == ["json"]
    small.check(b)
    small.check(c)  # evicts a, the least recently used
    small.check(b)
    assert compiles == ["json", "regex", "choice"]
    small.check(a)
    assert compiles == ["json", "regex", "choice", "json"]


def test_matchers_from_one_compiled_grammar_are_independent(backend, tokenizer):
    spec = StructuredOutputs(choice=CHOICES)
    m1, m2 = backend.matcher(spec), backend.matcher(spec)
    for t in tokenizer.encode("no", add_special_tokens=False):
        assert m1.accept(t)
    walk_text(backend, m2, tokenizer.encode("maybe later", add_special_tokens=False))


# --- bitmasks ----------------------------------------------------------------------------------


def test_allocate_bitmask_allows_everything():
    bitmask = allocate_bitmask(3, 70)
    assert bitmask.dtype == torch.int32 and bitmask.shape == (3, 3)
    assert bool((bitmask == -1).all())


def _reference_apply(logits: torch.Tensor, bitmask: torch.Tensor, rows: list[int] | None) -> torch.Tensor:
    out = logits.clone()
    for i in rows if rows is not None else range(logits.shape[0]):
        for t in range(logits.shape[1]):
            word = t // 32
            if word >= bitmask.shape[1] or not (int(bitmask[i, word]) >> (t % 32)) & 1:
                out[i, t] = float("-inf")
    return out


@pytest.mark.parametrize(
    ("vocab", "words", "rows", "dtype"),
    [
        (100, 4, None, torch.float32),
        (96, 3, None, torch.float32),
        (100, 4, [0, 3], torch.float32),
        (100, 3, None, torch.float32),  # logits wider than the mask
        (64, 4, [2], torch.float32),  # mask wider than the logits
        (100, 4, [], torch.float32),
        (100, 4, None, torch.bfloat16),
        (100, 4, [4, 1], torch.float16),
        (100, 4, None, torch.float64),
    ],
)
def test_apply_bitmask_matches_a_plain_loop(vocab, words, rows, dtype):
    gen = torch.Generator().manual_seed(vocab + words)
    logits = torch.randn(5, vocab, generator=gen).to(dtype)
    bitmask = torch.randint(-(2**31), 2**31, (5, words), generator=gen, dtype=torch.int64).to(torch.int32)
    bitmask[1] = -1  # all allowed
    bitmask[4] = 0  # nothing allowed
    want = _reference_apply(logits, bitmask, rows)
    got = logits.clone()
    apply_bitmask(got, bitmask, rows)
    assert torch.equal(got, want)


def test_apply_bitmask_on_a_strided_view():
    gen = torch.Generator().manual_seed(5)
    base = torch.randn(3, 80, generator=gen)
    bitmask = torch.randint(-(2**31), 2**31, (3, 2), generator=gen, dtype=torch.int64).to(torch.int32)
    want = _reference_apply(base[:, 10:74], bitmask, None)
    view = base[:, 10:74]  # not contiguous
    apply_bitmask(view, bitmask)
    assert torch.equal(base[:, 10:74], want)
    assert bool(torch.isfinite(base[:, :10]).all() and torch.isfinite(base[:, 74:]).all())


def test_apply_bitmask_with_a_filled_mask(backend, tokenizer):
    m = backend.matcher(StructuredOutputs(choice=CHOICES))
    bitmask = allocate_bitmask(2, backend.vocab_size)
    m.fill_bitmask(bitmask, 1)
    logits = torch.zeros(2, backend.vocab_size)
    apply_bitmask(logits, bitmask)
    assert torch.equal(torch.isfinite(logits[1]), allowed(m, backend.vocab_size))
    assert bool(torch.isfinite(logits[0]).all())
