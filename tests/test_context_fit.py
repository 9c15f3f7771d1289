"""A KV pool too small for the model's default context: the engine serves the context the pool holds
and says so, where no context length was asked for; an asked-for one that does not fit is an error
naming what does. (A 1.7B-parameter model's default 1 GB pool holds ~5,400 of its 8,192 tokens.)"""

from __future__ import annotations

import logging

import pytest

from tokenmill import LLM, SamplingParams

# The embedded model's KV is 30 layers x 3 heads x 64 x (K, V) x 2 bytes = 23,040 bytes a token (bf16).
TOKEN_BYTES = 30 * 3 * 64 * 2 * 2
BLOCK = 16


def test_default_context_lowered_to_what_the_pool_holds(caplog) -> None:
    gb = 0.05
    blocks = int(gb * 2**30 // (TOKEN_BYTES * BLOCK))
    with caplog.at_level(logging.WARNING, logger="tokenmill.engine.engine_core"):
        llm = LLM(dtype="bfloat16", kv_cache_memory_gb=gb)
    assert llm.engine.max_model_len == blocks * BLOCK < 8192
    assert any("max_model_len set to" in r.getMessage() for r in caplog.records)
    out = llm.generate(["The capital of France is"], SamplingParams(temperature=0, max_tokens=4))[0]
    assert len(out.outputs[0].token_ids) == 4
    with pytest.raises(ValueError, match="context length"):
        llm.generate([[1] * (blocks * BLOCK + 10)], SamplingParams(max_tokens=1))


def test_asked_for_context_that_does_not_fit_is_an_error() -> None:
    with pytest.raises(
        ValueError, match=r"cannot hold one request of max_model_len=8192 tokens \(it holds \d+\)"
    ):
        LLM(dtype="bfloat16", kv_cache_memory_gb=0.05, max_model_len=8192)


def test_a_pool_too_small_for_any_useful_context_is_an_error() -> None:
    with pytest.raises(ValueError, match="cannot hold one request"):
        LLM(dtype="bfloat16", kv_cache_memory_gb=0.004)
