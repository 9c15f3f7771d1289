"""The engine options the OpenAI request bodies carry beside OpenAI's own fields, without a server: output
constraints become one StructuredOutputs (or a RequestFieldError naming the field), and `speculative`
reaches the request's SamplingParams."""

from __future__ import annotations

import json
from typing import Any

import pytest

from tokenmill.sampling_params import StructuredOutputs
from tokenmill.server.openai_protocol import ChatCompletionRequest, CompletionRequest, RequestFieldError

JSON_OBJECT = {"type": "json_object"}
SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}}


@pytest.mark.parametrize(
    ("fields", "expected", "source"),
    [
        ({"response_format": JSON_OBJECT}, StructuredOutputs(json_object=True), "response_format"),
        (
            {"response_format": {"type": "json_schema", "json_schema": {"name": "s", "schema": SCHEMA}}},
            StructuredOutputs(json=json.dumps(SCHEMA)),
            "response_format",
        ),
        ({"structured_outputs": {"regex": "[0-9]"}}, StructuredOutputs(regex="[0-9]"), "structured_outputs"),
        ({"guided_json": SCHEMA}, StructuredOutputs(json=json.dumps(SCHEMA)), "guided_json"),
        ({"guided_choice": ["x", "y"]}, StructuredOutputs(choice=["x", "y"]), "guided_choice"),
        ({"guided_grammar": 'start: "a"'}, StructuredOutputs(grammar='start: "a"'), "guided_grammar"),
    ],
)
def test_each_field_gives_its_constraint(fields: dict[str, Any], expected: StructuredOutputs, source: str):
    req = CompletionRequest(prompt="hi", **fields)
    assert req.output_constraint() == (expected, source)


def test_text_format_is_no_constraint() -> None:
    assert CompletionRequest(prompt="hi", response_format={"type": "text"}).output_constraint() is None


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"guided_json": "", "guided_choice": []}, "guided_json"),
        ({"guided_json": ""}, "guided_json"),
        ({"guided_choice": []}, "guided_choice"),
        ({"guided_regex": ""}, "guided_regex"),
        ({"structured_outputs": {"regex": "a", "choice": ["b"]}}, "structured_outputs"),
        ({"structured_outputs": {}}, "structured_outputs"),
        ({"response_format": {"type": "json_object"}, "guided_regex": "a"}, "guided_regex"),
    ],
)
def test_empty_or_several_constraints_name_the_field(fields: dict[str, Any], param: str) -> None:
    with pytest.raises(RequestFieldError) as info:
        ChatCompletionRequest(messages=[{"role": "user", "content": "hi"}], **fields).output_constraint()
    assert info.value.param == param


def test_speculative_opt_out_reaches_the_sampling_params() -> None:
    assert CompletionRequest(prompt="hi").sampling_params(5, None).speculative is True
    assert CompletionRequest(prompt="hi", speculative=False).sampling_params(5, None).speculative is False
    chat = ChatCompletionRequest(messages=[{"role": "user", "content": "hi"}], speculative=False)
    assert chat.sampling_params(5, None).speculative is False
