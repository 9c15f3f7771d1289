"""Big bodies under the size cap do not hold the server (issue #51, item 5): text that cannot fit the
context is refused before it is tokenized, and what is tokenized is tokenized off the event loop, so
`/health` answers while a request's prompts are being counted."""

from __future__ import annotations

import asyncio
import threading

import httpx
import pytest
from server_fixture import running_server

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def server():
    with running_server() as proc:
        yield proc


def test_text_that_cannot_fit_is_refused_before_tokenizing(server) -> None:
    big = "word " * 4_000_000  # 20 MB: at least 27,000 tokens whatever the tokenizer does
    for path, body in (
        ("/tokenize", {"prompt": big}),
        ("/v1/completions", {"prompt": big, "max_tokens": 1}),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": big}], "max_tokens": 1}),
    ):
        r = httpx.post(f"{server.base_url}{path}", json=body, timeout=120)
        assert r.status_code == 400, (path, r.text[:200])
        assert "more than" in r.json()["error"]["message"], r.text[:300]


def test_prompts_are_tokenized_off_the_event_loop() -> None:
    """The tokenizer runs on another thread than the event loop's, for prompts and chats alike."""
    from types import SimpleNamespace

    from tokenmill.server.openai_serving import OpenAIServing
    from tokenmill.weights import catalog
    from tokenmill.weights.tokenizer_source import load_tokenizer

    tok = load_tokenizer(catalog.resolve("smollm2-135m"), None)
    threads: list[threading.Thread] = []
    encode, encode_chat = tok.encode, tok.encode_chat

    def spy(fn):
        def call(*args, **kwargs):
            threads.append(threading.current_thread())
            return fn(*args, **kwargs)

        return call

    tok.encode, tok.encode_chat = spy(encode), spy(encode_chat)
    llm = SimpleNamespace(tokenizer=tok, max_model_len=1024)
    serving = OpenAIServing.__new__(OpenAIServing)
    serving.llm = llm

    async def main() -> tuple[threading.Thread, list[list[int]], list[int]]:
        ids = await serving.encode(["Hello world", "Good night"])
        chat = await serving.encode_chat([{"role": "user", "content": "Hi"}], True, {})
        return threading.current_thread(), ids, chat

    loop_thread, ids, chat = asyncio.run(main())
    tok.encode, tok.encode_chat = encode, encode_chat
    assert len(threads) >= 3 and all(t is not loop_thread for t in threads)
    assert ids == [encode("Hello world"), encode("Good night")]
    assert chat == encode_chat([{"role": "user", "content": "Hi"}], add_generation_prompt=True)
