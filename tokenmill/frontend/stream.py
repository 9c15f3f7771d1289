"""Streaming generation in this process: yields text deltas as the engine produces tokens."""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

from tokenmill.engine.protocol import EngineRequest
from tokenmill.frontend.output_processor import OutputProcessor
from tokenmill.sampling_params import SamplingParams

if TYPE_CHECKING:
    from tokenmill.llm import LLM


def stream_chat(llm: LLM, messages: list[dict[str, Any]], params: SamplingParams) -> Iterator[str]:
    ids = llm.tokenizer.encode_chat(messages, add_generation_prompt=True)
    yield from stream_ids(llm, ids, params)


def stream_ids(llm: LLM, prompt_ids: list[int], params: SamplingParams) -> Iterator[str]:
    proc = OutputProcessor(llm.tokenizer)
    eos = frozenset(llm.tokenizer.eos_token_ids)
    rid = f"stream-{time.monotonic_ns()}"
    (cid, cp), *_ = proc.add_request(rid, None, prompt_ids, params, time.monotonic())
    llm.engine.add_request(EngineRequest(cid, prompt_ids, cp, eos))
    try:
        while llm.engine.has_unfinished():
            for ro in llm.step(proc):
                if ro.outputs[0].delta_text:
                    yield ro.outputs[0].delta_text
    finally:
        llm.engine.abort([cid])
