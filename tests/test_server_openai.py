"""Integration: the real server on 127.0.0.1 with the embedded model, used through the official
`openai` client (sync, async, streaming) and httpx."""

from __future__ import annotations

import asyncio
import re

import httpx
import openai
import pytest
from server_fixture import running_server

from tokenmill import LLM, SamplingParams

pytestmark = pytest.mark.slow

PROMPTS = ["The capital of France is", "def fibonacci(n):", "Water boils at"]
CHAT = [{"role": "user", "content": "Name a primary color."}]


@pytest.fixture(scope="module")
def server():
    with running_server("--max-num-seqs", "64") as proc:
        yield proc


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="unused", max_retries=0)


def test_models(client: openai.OpenAI) -> None:
    assert [m.id for m in client.models.list().data] == ["smollm2-135m"]


def test_completions_equal_offline_generate(client: openai.OpenAI, llm_bf16: LLM) -> None:
    offline = llm_bf16.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=16, ignore_eos=True))
    for prompt, ref in zip(PROMPTS, offline, strict=True):
        r = client.completions.create(
            model="smollm2-135m", prompt=prompt, max_tokens=16, temperature=0, extra_body={"ignore_eos": True}
        )
        assert r.choices[0].text == ref.outputs[0].text
        assert r.choices[0].finish_reason == "length"
        assert r.usage.prompt_tokens == len(ref.prompt_token_ids) and r.usage.completion_tokens == 16


def test_chat_equals_offline_chat(client: openai.OpenAI, llm_bf16: LLM) -> None:
    ref = llm_bf16.chat(CHAT, SamplingParams(temperature=0, max_tokens=30))[0].outputs[0]
    r = client.chat.completions.create(model="smollm2-135m", messages=CHAT, temperature=0, max_tokens=30)
    assert r.choices[0].message.content == ref.text and r.choices[0].message.role == "assistant"
    assert r.choices[0].finish_reason == ref.finish_reason


def test_streaming_chat_with_usage(client: openai.OpenAI, llm_bf16: LLM) -> None:
    ref = llm_bf16.chat(CHAT, SamplingParams(temperature=0, max_tokens=30))[0]
    stream = client.chat.completions.create(
        model="smollm2-135m",
        messages=CHAT,
        temperature=0,
        max_completion_tokens=30,
        stream=True,
        stream_options={"include_usage": True},
    )
    text, usage, finish = "", None, None
    for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage
        for c in chunk.choices:
            text += c.delta.content or ""
            finish = c.finish_reason or finish
    assert text == ref.outputs[0].text and finish == ref.outputs[0].finish_reason
    assert usage.completion_tokens == len(ref.outputs[0].token_ids)
    assert usage.prompt_tokens == len(ref.prompt_token_ids)


def test_async_client_and_extra_sampling_fields(server) -> None:
    async def main():
        c = openai.AsyncOpenAI(base_url=f"{server.base_url}/v1", api_key="x", max_retries=0)
        kwargs = dict(
            model="smollm2-135m",
            prompt="List: apple, banana,",
            max_tokens=20,
            temperature=0.8,
            seed=5,
            n=2,
            stop=["\n"],
            logprobs=2,
            extra_body={"top_k": 20, "min_p": 0.05, "repetition_penalty": 1.1, "min_tokens": 2},
        )
        r = await c.completions.create(**kwargs)
        again = await c.completions.create(**kwargs)
        await c.close()
        return r, again

    r, again = asyncio.run(main())
    assert len(r.choices) == 2 and [c.index for c in r.choices] == [0, 1]
    assert [c.text for c in r.choices] == [c.text for c in again.choices], "seeded sampling is reproducible"
    for c in r.choices:
        assert "\n" not in c.text
        assert len(c.logprobs.tokens) == len(c.logprobs.token_logprobs)
        assert all(len(t) <= 2 for t in c.logprobs.top_logprobs)


def test_chat_logprobs(client: openai.OpenAI) -> None:
    r = client.chat.completions.create(
        model="smollm2-135m", messages=CHAT, max_tokens=5, temperature=0, logprobs=True, top_logprobs=3
    )
    content = r.choices[0].logprobs.content
    assert len(content) == r.usage.completion_tokens
    assert all(len(t.top_logprobs) == 3 and t.logprob <= 0 for t in content)


def test_64_concurrent_streams(server) -> None:
    async def one(c: openai.AsyncOpenAI, i: int):
        stream = await c.completions.create(
            model="smollm2-135m",
            prompt=f"Story number {i}:",
            max_tokens=12,
            temperature=0.7,
            seed=i,
            stream=True,
            stream_options={"include_usage": True},
            extra_body={"ignore_eos": True},
        )
        pieces, usage = 0, None
        async for chunk in stream:
            pieces += sum(1 for ch in chunk.choices if ch.text)
            usage = chunk.usage or usage
        return pieces, usage

    async def main():
        c = openai.AsyncOpenAI(base_url=f"{server.base_url}/v1", api_key="x", max_retries=0, timeout=120)
        res = await asyncio.gather(*(one(c, i) for i in range(64)))
        await c.close()
        return res

    def successes() -> float:
        text = httpx.get(f"{server.base_url}/metrics").text
        found = re.findall(
            r'^tokenmill:request_success_total\{[^}]*finished_reason="length"[^}]*\} (\S+)', text, re.M
        )
        return float(found[0]) if found else 0.0

    before = successes()
    results = asyncio.run(main())
    assert successes() - before == 64, "/metrics counts the 64 streams"
    assert len(results) == 64
    for pieces, usage in results:
        assert usage.completion_tokens == 12 and pieces >= 1
        assert usage.total_tokens == usage.prompt_tokens + 12


def test_tokenize_detokenize(server) -> None:
    r = httpx.post(f"{server.base_url}/tokenize", json={"prompt": "Hello world"}).json()
    assert r["count"] == len(r["tokens"]) > 0
    assert (
        httpx.post(f"{server.base_url}/detokenize", json={"tokens": r["tokens"]}).json()["prompt"]
        == "Hello world"
    )


def test_health_and_metadata(server) -> None:
    base = server.base_url
    assert httpx.get(f"{base}/health").status_code == 200
    assert httpx.get(f"{base}/v1/health/live").status_code == 200
    assert httpx.get(f"{base}/v1/health/ready").json()["message"] == "ready"
    assert httpx.get(f"{base}/v1/version").json()["release"]
    meta = httpx.get(f"{base}/v1/metadata").json()
    assert meta["model"] == "smollm2-135m" and meta["max_model_len"] == 1024


@pytest.mark.parametrize(
    ("path", "body", "status", "needle"),
    [
        ("/v1/completions", "{not json", 400, "not valid JSON"),
        ("/v1/completions", {"prompt": "x", "model": "gpt-4"}, 404, "does not exist"),
        ("/v1/completions", {"prompt": "x", "temperature": "hot"}, 400, "temperature"),
        ("/v1/completions", {"prompt": "x", "top_p": 1.5}, 400, "top_p"),
        ("/v1/completions", {"prompt": "x", "max_tokens": -1}, 400, "max_tokens"),
        ("/v1/chat/completions", {"messages": CHAT, "max_tokens": 0}, 400, "max_tokens"),
        ("/v1/completions", {"prompt": "x", "n": 0}, 400, "n"),
        ("/v1/completions", {"prompt": "word " * 1200}, 400, "context length"),
        ("/v1/completions", {"prompt": "x", "max_tokens": 5000}, 400, "max_tokens"),
        ("/v1/completions", {"prompt": [999999]}, 400, "token ids"),
        ("/v1/completions", {"max_tokens": 3}, 400, "prompt"),
        ("/v1/chat/completions", {"messages": []}, 400, "messages"),
        ("/v1/chat/completions", {"messages": [{"role": "wizard", "content": "x"}]}, 400, "role"),
        ("/v1/chat/completions", {"messages": CHAT, "logit_bias": {"abc": 1}}, 400, "logit_bias"),
        ("/v1/chat/completions", {"messages": CHAT, "top_logprobs": 3}, 400, "logprobs"),
    ],
)
def test_bad_input_is_400_in_openai_shape(server, path: str, body, status: int, needle: str) -> None:
    kw = (
        {"content": body, "headers": {"content-type": "application/json"}}
        if isinstance(body, str)
        else {"json": body}
    )
    r = httpx.post(f"{server.base_url}{path}", **kw)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert needle in err["message"] and err["code"] == status and err["type"]


OPENAI_ERROR_KEYS = {"message", "type", "param", "code"}


def test_unknown_routes_answer_in_openai_shape(client: openai.OpenAI, server) -> None:
    # The official client reads the body's "error" object into the exception; FastAPI's own
    # {"detail": "Not Found"} would leave it nothing but that dict.
    for call in (
        lambda: client.get("/nonexistent", cast_to=object),
        lambda: client.post("/nonexistent", cast_to=object, body={"model": "smollm2-135m"}),
    ):
        with pytest.raises(openai.NotFoundError) as e:
            call()
        assert set(e.value.body) == OPENAI_ERROR_KEYS, e.value.body
        assert "/v1/nonexistent" in e.value.body["message"] and e.value.body["code"] == 404
    # A method the path does not take: 405 with the methods it does take.
    with pytest.raises(openai.APIStatusError) as e:
        client.get("/chat/completions", cast_to=object)
    assert e.value.status_code == 405 and e.value.response.headers["allow"] == "POST"
    assert set(e.value.body) == OPENAI_ERROR_KEYS and "POST" in e.value.body["message"], e.value.body
    # Paths outside /v1 that are not KServe's (/v2) answer alike.
    r = httpx.delete(f"{server.base_url}/tokenize")
    assert r.status_code == 405 and set(r.json()["error"]) == OPENAI_ERROR_KEYS, r.text
    r = httpx.get(f"{server.base_url}/nonexistent")
    assert r.status_code == 404 and set(r.json()["error"]) == OPENAI_ERROR_KEYS, r.text
    # A server without a model repository serves no /v2; a KServe client still reads why, in its shape.
    from tritonclient.http import InferenceServerClient
    from tritonclient.utils import InferenceServerException

    with pytest.raises(InferenceServerException, match="no --model-repository"):
        InferenceServerClient(server.base_url.removeprefix("http://")).get_model_metadata("any")


def test_langchain_reports_an_unknown_route_as_such(server) -> None:
    langchain_openai = pytest.importorskip("langchain_openai", reason="langchain-openai is a dev dependency")

    def chat(base_url: str):
        return langchain_openai.ChatOpenAI(
            base_url=base_url,
            api_key="unused",
            model="smollm2-135m",
            max_tokens=4,
            temperature=0,
            max_retries=0,
        )

    # The same client, pointed at the right base URL, is served: only the route differs below.
    assert chat(f"{server.base_url}/v1").invoke("Hi").response_metadata["model_name"] == "smollm2-135m"
    # langchain files every 404 as a model-not-found error; the message is what tells the user the URL
    # is wrong, and it is the server's only when the body has OpenAI's shape.
    with pytest.raises(openai.NotFoundError) as e:
        chat(f"{server.base_url}/v1/nonexistent").invoke("Hi")
    assert set(e.value.body) == OPENAI_ERROR_KEYS, e.value.body
    assert "Invalid URL (POST /v1/nonexistent/chat/completions)" in str(e.value)
