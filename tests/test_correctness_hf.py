"""Greedy outputs token-identical to Hugging Face transformers on the same weights (float32).

The same prompts go through our engine alone, batched with different lengths, with prefix-cache
hits, with chunked prefill at several chunk sizes, and under preemption (a KV pool too small for
the batch). Logprobs are compared with the reference's log-softmax within a stated tolerance.
"""

from __future__ import annotations

import pytest
from reference import hf_greedy

from tokenmill import LLM, SamplingParams

pytestmark = pytest.mark.slow

NEW_TOKENS = 24
# Largest absolute difference allowed between our and the reference's logprobs (float32, same math
# in another order): observed ~1e-5; 2e-3 leaves room without hiding real errors (those are >0.1).
LOGPROB_TOL = 2e-3

CONVERSATIONS = [
    "What is the capital of France?",
    "Write a haiku about paged attention.",
    "List three prime numbers greater than 100 and explain why each is prime.",
    "hi",
]
RAW_PROMPTS = [
    "The quick brown fox",
    "def fibonacci(n):\n    ",
    "In 1969, the first humans landed on the Moon. The mission was called",
]
SHARED_PREFIX = (
    "You are a meticulous assistant who answers questions about the history of computing. "
    "Always give the year, the people involved and one surprising detail. "
) * 4


@pytest.fixture(scope="module")
def prompts(llm_fp32: LLM) -> list[list[int]]:
    tok = llm_fp32.tokenizer
    ids = [tok.encode_chat([{"role": "user", "content": c}]) for c in CONVERSATIONS]
    ids += [tok.encode(p) for p in RAW_PROMPTS]
    ids += [tok.encode(SHARED_PREFIX + q) for q in ("Who built ENIAC?", "Who designed the Zuse Z3?")]
    return ids


@pytest.fixture(scope="module")
def reference(hf_model, prompts) -> list[tuple[list[int], list]]:
    return [hf_greedy(hf_model, p, NEW_TOKENS) for p in prompts]


def greedy(logprobs: int | None = None) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True, logprobs=logprobs)


def assert_matches(outs, reference) -> None:
    for i, (out, (ref_tokens, _)) in enumerate(zip(outs, reference, strict=True)):
        assert out.outputs[0].token_ids == ref_tokens, f"prompt {i} diverges from transformers"


def test_one_at_a_time(llm_fp32: LLM, prompts, reference) -> None:
    llm_fp32.engine.kv.pool.reset_prefix_cache()
    for p, ref in zip(prompts, reference, strict=True):
        out = llm_fp32.generate([p], greedy(logprobs=5))[0]
        assert out.outputs[0].token_ids == ref[0]
        for ours, theirs in zip(out.outputs[0].logprobs, ref[1], strict=True):
            assert abs(ours.logprob - float(theirs[ours.token_id])) < LOGPROB_TOL
            for tid, lp in ours.top:
                assert abs(lp - float(theirs[tid])) < LOGPROB_TOL
            assert [t for t, _ in ours.top] == theirs.topk(5).indices.tolist()


def test_batched_different_lengths(llm_fp32: LLM, prompts, reference) -> None:
    llm_fp32.engine.kv.pool.reset_prefix_cache()
    assert_matches(llm_fp32.generate(prompts, greedy()), reference)


def test_prefix_cache_hits(llm_fp32: LLM, prompts, reference) -> None:
    engine = llm_fp32.engine
    engine.kv.pool.reset_prefix_cache()
    llm_fp32.generate(prompts, greedy())  # fills the cache
    hits_before = engine.kv.prefix_cache_hits
    outs = llm_fp32.generate(prompts, greedy())
    assert engine.kv.prefix_cache_hits > hits_before
    assert all(o.num_cached_tokens > 0 for o in outs if len(o.prompt_token_ids) > 16)
    assert_matches(outs, reference)


def test_shared_prefix_reused_within_one_batch(llm_fp32: LLM, prompts, reference) -> None:
    # The two SHARED_PREFIX prompts: the second reuses blocks the first fills in the same step.
    llm_fp32.engine.kv.pool.reset_prefix_cache()
    outs = llm_fp32.generate(prompts[-2:], greedy())
    assert outs[1].num_cached_tokens >= 64
    assert_matches(outs, reference[-2:])


@pytest.mark.parametrize("chunk", [7, 16, 50])
def test_chunked_prefill(llm_fp32: LLM, prompts, reference, chunk: int) -> None:
    sched = llm_fp32.engine.scheduler.config
    saved = sched.max_num_batched_tokens
    sched.max_num_batched_tokens = chunk
    try:
        llm_fp32.engine.kv.pool.reset_prefix_cache()
        assert_matches(llm_fp32.generate(prompts, greedy()), reference)
    finally:
        sched.max_num_batched_tokens = saved


def test_preemption_with_small_kv_pool(prompts, reference) -> None:
    # 20 blocks of 16 tokens cannot hold all 9 requests (~40-110 tokens each when done) at once.
    llm = LLM(dtype="float32", max_model_len=256, num_blocks=20, block_size=16)
    outs = llm.generate(prompts, greedy())
    assert llm.engine.scheduler.num_preemptions > 0
    assert any(o.outputs[0].metrics.num_preemptions > 0 for o in outs)
    assert_matches(outs, reference)
    assert llm.engine.kv.pool.num_free == 20  # everything returned


def test_reference_kernels_match(prompts, reference) -> None:
    # The plain-PyTorch path (attention and element-wise ops) that faster kernels are checked against.
    llm = LLM(dtype="float32", max_model_len=1024, kernels="torch")
    assert_matches(llm.generate(prompts, greedy()), reference)
