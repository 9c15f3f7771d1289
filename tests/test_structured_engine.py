"""Structured output in the engine: the sampler masks what the grammar forbids, at every position of a
speculative draft too, so outputs always match their schema, regex or choice (checked with
`jsonschema` and `re`), and greedy output is the same with and without speculation."""

from __future__ import annotations

import json
import re

import jsonschema
import pytest

from tokenmill.sampling_params import SamplingParams, StructuredOutputs
from tokenmill.structured import GrammarBackend

SCHEMAS = [
    {
        "type": "object",
        "properties": {
            "name": {"type": "string", "maxLength": 20},
            "age": {"type": "integer", "minimum": 0, "maximum": 120},
            "tags": {"type": "array", "items": {"enum": ["red", "green"]}, "minItems": 1, "maxItems": 3},
        },
        "required": ["name", "age", "tags"],
        "additionalProperties": False,
    },
    {
        "type": "object",
        "properties": {
            "city": {"type": "string", "maxLength": 16},
            "location": {
                "type": "object",
                "properties": {"lat": {"type": "number", "minimum": -90, "maximum": 90}},
                "required": ["lat"],
                "additionalProperties": False,
            },
            "note": {"type": "string", "maxLength": 10},
        },
        "required": ["city", "location"],
        "additionalProperties": False,
    },
]
PROMPTS = ["Describe a person as JSON.", "Give me a city with its latitude as JSON."]


def _chat(llm, spec: StructuredOutputs, **params) -> str:
    p = SamplingParams(max_tokens=160, structured=spec, **params)
    outs = llm.chat([[{"role": "user", "content": q}] for q in PROMPTS], p)
    return [o.outputs[0] for o in outs]


def _complete(llm, spec: StructuredOutputs, out) -> bool:
    """True if the output ended by its grammar (then the caller checks the whole value). An output cut by
    max_tokens (a small model can write digits or a string forever) must be a prefix the grammar
    accepts, token by token."""
    if out.finish_reason == "stop":
        return True
    assert out.finish_reason == "length", out.finish_reason
    mc = llm.engine.model_config
    matcher = GrammarBackend(llm.engine.tokenizer, mc.vocab_size).matcher(spec)
    assert matcher.validate(list(out.token_ids)) == len(out.token_ids), out.text
    return False


@pytest.fixture(scope="module", params=[None, "ngram"])
def llm(request):
    from tokenmill import LLM

    spec = {"speculative_config": {"method": request.param}} if request.param else {}
    engine = LLM(dtype="float32", max_model_len=1024, **spec)
    yield engine
    engine.close()


@pytest.mark.slow
@pytest.mark.parametrize("schema", SCHEMAS, ids=["person", "city"])
@pytest.mark.parametrize(
    "params", [{"temperature": 0}, {"temperature": 1.0, "seed": 7}], ids=["greedy", "seeded"]
)
def test_json_schema_outputs_validate(llm, schema, params):
    spec = StructuredOutputs(json=json.dumps(schema))
    outs = _chat(llm, spec, **params)
    for out in outs:
        if _complete(llm, spec, out):
            jsonschema.validate(json.loads(out.text), schema)
    # (Greedy, this small model writes the city's latitude digits until max_tokens; such an output is
    # checked as a grammar prefix above. Completion itself is asserted in the json_object test.)


@pytest.mark.slow
def test_json_object_regex_and_choice(llm):
    spec = StructuredOutputs(json_object=True)
    # Several seeds: whether this small model closes its object within max_tokens is up to the draws.
    outs = [o for seed in (1, 2, 3) for o in _chat(llm, spec, temperature=0.8, seed=seed)]
    for out in outs:
        if _complete(llm, spec, out):
            assert isinstance(json.loads(out.text), dict)
    assert any(o.finish_reason == "stop" for o in outs), "no output was complete: nothing parsed"
    for out in _chat(llm, StructuredOutputs(regex=r"[0-9]{3}-[a-z]{2,4}"), temperature=1.0, seed=2):
        assert re.fullmatch(r"[0-9]{3}-[a-z]{2,4}", out.text), out.text
    for out in _chat(
        llm, StructuredOutputs(choice=["alpha", "beta", "gamma delta"]), temperature=1.0, seed=3
    ):
        assert out.text in ("alpha", "beta", "gamma delta")


@pytest.mark.slow
def test_greedy_structured_output_is_the_same_with_speculation(llm):
    from tokenmill import LLM

    spec = StructuredOutputs(json=json.dumps(SCHEMAS[0]))
    got = [o.text for o in _chat(llm, spec, temperature=0)]
    plain = LLM(dtype="float32", max_model_len=1024)
    try:
        assert got == [o.text for o in _chat(plain, spec, temperature=0)]
    finally:
        plain.close()


STRINGS = {"type": "array", "items": {"type": "string"}, "minItems": 2, "maxItems": 4}


@pytest.mark.slow
def test_sampled_outputs_are_complete_or_cut_by_max_tokens(llm):
    """Many seeds at temperature 0.7: every output is a document that validates and ends with "stop", or
    was cut by max_tokens ("length", a prefix its grammar accepts). Nothing else may end it early: not the
    request's stop strings or stop token ids (here the very text between two items), and min_tokens may
    not make a complete document fail (its grammar then allows nothing but the end)."""
    spec = StructuredOutputs(json=json.dumps(STRINGS))
    between = llm.tokenizer.encode('", "', add_special_tokens=False)  # text inside any array of 2+ items
    extras: list[dict] = [{}] * 24
    extras += [{"stop": [",", '"'], "stop_token_ids": between}] * 12
    extras += [{"min_tokens": 150}] * 12
    # Both: a complete document then allows only its end, and a stop id's text must not follow it.
    extras += [{"stop_token_ids": between, "min_tokens": 150, "temperature": 1.0}] * 24
    params = [
        SamplingParams(**{"temperature": 0.7, "max_tokens": 200, "seed": seed, "structured": spec, **extra})
        for seed, extra in enumerate(extras)
    ]
    chat = [{"role": "user", "content": "List a few fruits as a JSON array of strings."}]
    outs = [o.outputs[0] for o in llm.chat([chat] * len(params), params)]
    for p, out in zip(params, outs, strict=True):
        if _complete(llm, spec, out):
            jsonschema.validate(json.loads(out.text), STRINGS)
            assert out.token_ids[-1] in llm.tokenizer.eos_token_ids | set(p.stop_token_ids)
        else:
            assert len(out.token_ids) == 200, (p, out.text)
    assert any(o.finish_reason == "stop" for o in outs), "no output was complete: nothing validated"
