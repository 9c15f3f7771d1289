"""Completions for scoring and the fields around them, through the official `openai` client against the
real server, float32: `echo` with the prompt's logprobs and offsets, `max_tokens: 0` (lm-eval's
loglikelihood requests), vLLM's `prompt_logprobs`, `best_of`, `continuous_usage_stats`, and the fields
refused by name. The reference for every logprob is transformers' log-softmax on the same tokens."""

from __future__ import annotations

import httpx
import openai
import pytest
import torch
from server_fixture import running_server

pytestmark = pytest.mark.slow

MODEL = "smollm2-135m"
PROMPT = "The quick brown fox jumps over the lazy dog."
TOL = 1e-4


@pytest.fixture(scope="module")
def server():
    with running_server("--dtype", "float32", "--max-num-batched-tokens", "8") as proc:  # prompts in chunks
        yield proc


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="unused", max_retries=0)


def hf_logprobs(hf_model, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return torch.log_softmax(hf_model(torch.tensor([ids])).logits[0].double(), -1)


def prompt_ids(server) -> list[int]:
    return httpx.post(f"{server.base_url}/tokenize", json={"prompt": PROMPT}).json()["tokens"]


def test_echo_scores_the_prompt_with_max_tokens_0(client: openai.OpenAI, server, hf_model) -> None:
    ids = prompt_ids(server)
    r = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=0, echo=True, logprobs=2)
    choice = r.choices[0]
    assert choice.text == PROMPT and r.usage.completion_tokens == 0 and choice.finish_reason == "length"
    lp = choice.logprobs
    ref = hf_logprobs(hf_model, ids)
    assert len(lp.tokens) == len(ids) and "".join(lp.tokens) == PROMPT
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    for k in range(1, len(ids)):
        assert abs(lp.token_logprobs[k] - ref[k - 1, ids[k]].item()) <= TOL
        assert len(lp.top_logprobs[k]) <= 2  # two alternatives (fewer if two decode to one string)
    offsets = [0]
    for t in lp.tokens[:-1]:
        offsets.append(offsets[-1] + len(t))
    assert lp.text_offset == offsets


def test_echo_with_generation_and_prompt_logprobs(client: openai.OpenAI, server, hf_model) -> None:
    ids = prompt_ids(server)
    plain = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=4, temperature=0, logprobs=1)
    echoed = client.completions.create(
        model=MODEL, prompt=PROMPT, max_tokens=4, temperature=0, logprobs=1, echo=True,
        extra_body={"prompt_logprobs": 1},
    )  # fmt: skip
    c = echoed.choices[0]
    assert c.text == PROMPT + plain.choices[0].text
    assert len(c.logprobs.tokens) == len(ids) + 4
    # The same tokens' logprobs (computed in other chunks: the echoed prompt takes no prefix-cache hit).
    generated = c.logprobs.token_logprobs[len(ids) :]
    assert all(
        abs(a - b) <= TOL for a, b in zip(generated, plain.choices[0].logprobs.token_logprobs, strict=True)
    )
    # vLLM's prompt_logprobs: per prompt token, keyed by token id.
    plps = c.model_extra["prompt_logprobs"]
    ref = hf_logprobs(hf_model, ids)
    assert plps[0] is None and len(plps) == len(ids)
    for k in range(1, len(ids)):
        assert abs(plps[k][str(ids[k])]["logprob"] - ref[k - 1, ids[k]].item()) <= TOL


def test_best_of_returns_the_most_likely_of_its_samples(client: openai.OpenAI) -> None:
    kw = {"model": MODEL, "prompt": PROMPT, "max_tokens": 6, "temperature": 1.0, "seed": 7}
    samples = client.completions.create(n=3, logprobs=0, **kw).choices  # the same draws: seeds 7, 8, 9
    best = max(samples, key=lambda c: sum(c.logprobs.token_logprobs))
    r = client.completions.create(best_of=3, **kw)
    assert len(r.choices) == 1 and r.choices[0].text == best.text and r.choices[0].logprobs is None
    assert r.usage.completion_tokens == sum(len(c.logprobs.tokens) for c in samples)


def test_continuous_usage_stats(client: openai.OpenAI) -> None:
    opts = {"include_usage": True, "continuous_usage_stats": True}
    for stream in (
        client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=5, stream=True, stream_options=opts),
        client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=5, stream=True,
            stream_options=opts,
        ),
    ):  # fmt: skip
        chunks = list(stream)
        counts = [c.usage.completion_tokens for c in chunks if c.choices and c.usage is not None]
        assert counts and counts == sorted(counts)
        assert chunks[-1].usage.completion_tokens == counts[-1] == 5


def test_streamed_echo_starts_with_the_prompt(client: openai.OpenAI) -> None:
    chunks = list(client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=3, echo=True, stream=True))
    assert chunks[0].choices[0].text == PROMPT
    whole = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=3, echo=True, temperature=0)
    streamed = client.completions.create(
        model=MODEL, prompt=PROMPT, max_tokens=3, echo=True, temperature=0, stream=True
    )
    assert "".join(c.choices[0].text for c in streamed) == whole.choices[0].text


@pytest.mark.parametrize(
    ("body", "needle"),
    [
        ({"suffix": "end"}, "suffix"),
        ({"n": 3, "best_of": 2}, "best_of (2) must be at least n (3)"),
        ({"best_of": 2, "stream": True}, "cannot be streamed"),
        ({"prompt_logprobs": 21}, "prompt_logprobs"),
        ({"max_tokens": -1}, "max_tokens"),
        ({"prompt_logprobs": 1, "stream": True}, "do not stream"),
    ],
)
def test_refused_by_name(server, body: dict, needle: str) -> None:
    r = httpx.post(f"{server.base_url}/v1/completions", json={"model": MODEL, "prompt": PROMPT, **body})
    assert r.status_code == 400 and needle in r.json()["error"]["message"], r.text


def test_chat_prompt_logprobs_are_the_rendered_prompts(client: openai.OpenAI, server, hf_model) -> None:
    messages = [{"role": "user", "content": "Hi!"}]
    r = client.chat.completions.create(
        model=MODEL, messages=messages, max_tokens=1, extra_body={"prompt_logprobs": 0}
    )
    ids = httpx.post(f"{server.base_url}/tokenize", json={"messages": messages}).json()["tokens"]
    plps = r.model_extra["prompt_logprobs"]
    ref = hf_logprobs(hf_model, ids)
    assert plps[0] is None and len(plps) == len(ids)
    assert (
        max(abs(plps[k][str(ids[k])]["logprob"] - ref[k - 1, ids[k]].item()) for k in range(1, len(ids)))
        <= TOL
    )
