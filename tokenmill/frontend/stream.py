"""Streaming generation in this process: text deltas as the engine produces tokens, for the chat CLI.

A synchronous iterator over the offline LLM's frontend (the same AsyncLLM the server streams from)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

from tokenmill.sampling_params import SamplingParams

if TYPE_CHECKING:
    from tokenmill.llm import LLM


def stream_chat(llm: LLM, messages: list[dict[str, Any]], params: SamplingParams) -> Iterator[str]:
    ids = llm.tokenizer.encode_chat(messages, add_generation_prompt=True)
    yield from stream_ids(llm, ids, params)


def stream_ids(llm: LLM, prompt_ids: list[int], params: SamplingParams) -> Iterator[str]:
    """Deltas of the first sequence; stopping the iteration early aborts the request."""
    agen = llm.frontend.generate(f"stream-{llm.next_request_id()}", prompt_ids, params)
    try:
        while True:
            try:
                ro = llm.run_sync(agen.__anext__())
            except StopAsyncIteration:
                return
            if ro.outputs[0].delta_text:
                yield ro.outputs[0].delta_text
    finally:
        llm.run_sync(agen.aclose())
