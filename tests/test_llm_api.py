"""The offline API: prompt forms, n > 1, stop conditions, seeds, abort, timestamps, bad input."""

from __future__ import annotations

import pytest

from tokenmill import LLM, SamplingParams
from tokenmill.engine.request import EngineRequest

pytestmark = pytest.mark.slow

GREEDY = SamplingParams(temperature=0, max_tokens=20)


def test_prompt_forms(llm_bf16: LLM) -> None:
    ids = llm_bf16.tokenizer.encode("The capital of Italy is")
    a = llm_bf16.generate("The capital of Italy is", GREEDY)
    b = llm_bf16.generate(ids, GREEDY)
    c = llm_bf16.generate(["The capital of Italy is", ids], [GREEDY, GREEDY])
    assert len(a) == len(b) == 1 and len(c) == 2
    assert a[0].outputs[0].token_ids == b[0].outputs[0].token_ids == c[1].outputs[0].token_ids
    assert a[0].prompt == "The capital of Italy is" and b[0].prompt is None
    assert a[0].outputs[0].text == llm_bf16.tokenizer.decode(a[0].outputs[0].token_ids)


def test_outputs_keep_prompt_order(llm_bf16: LLM) -> None:
    prompts = [f"Count to {i}:" for i in range(1, 9)]
    outs = llm_bf16.generate(prompts, SamplingParams(temperature=0, max_tokens=4))
    assert [o.prompt for o in outs] == prompts


def test_finish_reasons(llm_bf16: LLM) -> None:
    out = llm_bf16.generate("Once upon a time", SamplingParams(temperature=0, max_tokens=5, ignore_eos=True))[
        0
    ]
    assert out.outputs[0].finish_reason == "length" and len(out.outputs[0].token_ids) == 5
    # EOS made the greedy choice by a logit bias (whether the model itself would end here is the
    # model's business, and a near-tie on some CPU), held back for min_tokens.
    eos = min(llm_bf16.tokenizer.eos_token_ids)
    p = SamplingParams(temperature=0, max_tokens=200, logit_bias={eos: 100.0}, min_tokens=3)
    chat = llm_bf16.chat([{"role": "user", "content": "Say hello."}], p)
    assert chat[0].outputs[0].finish_reason == "stop"
    ids = chat[0].outputs[0].token_ids
    assert chat[0].outputs[0].stop_reason == eos and len(ids) == 4 and ids[-1] == eos and eos not in ids[:3]


def test_stop_strings(llm_bf16: LLM) -> None:
    base = llm_bf16.generate(
        "Once upon a time", SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
    )[0]
    text = base.outputs[0].text
    # A 4-character piece from the middle of the continuation, whatever the model said.
    start = next(i for i in range(10, len(text) - 4) if text[i : i + 4].strip())
    stop = text[start : start + 4]
    cut = text[: text.find(stop)]
    p = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True, stop=[stop])
    out = llm_bf16.generate("Once upon a time", p)[0].outputs[0]
    assert out.text == cut and out.finish_reason == "stop" and out.stop_reason == stop
    p2 = SamplingParams(
        temperature=0, max_tokens=30, ignore_eos=True, stop=stop, include_stop_str_in_output=True
    )
    assert llm_bf16.generate("Once upon a time", p2)[0].outputs[0].text == cut + stop
    assert llm_bf16.engine.kv.pool.num_free == llm_bf16.engine.kv.pool.num_blocks


def test_stop_token_ids_and_min_tokens(llm_bf16: LLM) -> None:
    base = llm_bf16.generate(
        "Once upon a time", SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    )[0]
    ids = base.outputs[0].token_ids
    out = llm_bf16.generate(
        "Once upon a time", SamplingParams(temperature=0, max_tokens=12, stop_token_ids=[ids[3]])
    )
    first = ids.index(ids[3])
    assert out[0].outputs[0].token_ids == ids[: first + 1]
    assert out[0].outputs[0].stop_reason == ids[3]
    # The stop token's text is not in the output (as vLLM), unless asked for.
    tok = llm_bf16.tokenizer
    assert out[0].outputs[0].text == tok.decode(ids[:first], skip_special_tokens=True)
    p = SamplingParams(temperature=0, max_tokens=12, stop_token_ids=[ids[3]], include_stop_str_in_output=True)
    kept = llm_bf16.generate("Once upon a time", p)[0].outputs[0]
    assert kept.text == tok.decode(ids[: first + 1], skip_special_tokens=True)
    # min_tokens: the stop token cannot end the sequence before 8 tokens.
    p = SamplingParams(temperature=0, max_tokens=12, stop_token_ids=[ids[3]], min_tokens=8)
    assert len(llm_bf16.generate("Once upon a time", p)[0].outputs[0].token_ids) >= 8


def test_n_sequences_and_seeds(llm_bf16: LLM) -> None:
    p = SamplingParams(n=3, temperature=1.0, max_tokens=12, seed=7, ignore_eos=True)
    a = llm_bf16.generate("Tell me a story", p)[0]
    assert [o.index for o in a.outputs] == [0, 1, 2]
    texts = [o.text for o in a.outputs]
    assert len(set(texts)) > 1, "n sequences with different seeds should differ"
    # Reproducible whatever else is in the batch.
    noise = SamplingParams(temperature=1.0, max_tokens=12)
    b = llm_bf16.generate(["Tell me a story", "Something else entirely", "More noise"], [p, noise, noise])[0]
    assert [o.text for o in b.outputs] == texts


def test_seeded_tokens_depend_only_on_seed_and_position(llm_fp32: LLM) -> None:
    """float32, temperature 1, several prompts and seeds: a seeded request's tokens are the same with its
    prompt's prefix cached or not, alone or in a batch, and with speculative decoding, whose drafts (with
    the suffix proposer, taken from earlier requests' outputs too) change how many tokens each step
    verifies. The logits of those passes differ in their last bits, which moves a seeded draw only when
    its two best scores are that close (worker/sampler.py)."""
    base = "A quiet forest where a fox, an owl and a bear tell each other stories every night. " * 2
    prompts = [base + t for t in ("The fox said", "The owl asked the bear", "Then the rain came and")]
    seeds = [1, 2]

    def params(seed: int) -> SamplingParams:
        return SamplingParams(temperature=1.0, max_tokens=24, seed=seed, ignore_eos=True)

    def alone(llm: LLM, prompt: str, seed: int, cached: bool) -> list[int]:
        if not cached:
            llm.engine.kv.pool.reset_prefix_cache()
        out = llm.generate(prompt, params(seed))[0]
        assert (out.num_cached_tokens > 0) == cached
        return out.outputs[0].token_ids

    cold = {(q, s): alone(llm_fp32, q, s, cached=False) for s in seeds for q in prompts}
    spec = LLM(
        dtype="float32",
        max_model_len=1024,
        num_blocks=64,
        speculative_config={"method": "suffix", "num_speculative_tokens": 5},
    )
    try:
        for llm in (llm_fp32, spec):
            for (q, s), want in cold.items():
                assert alone(llm, q, s, cached=False) == want, ("cold", q, s)
                assert alone(llm, q, s, cached=True) == want, ("cached", q, s)
            batch = llm.generate([q for q, _ in cold], [params(s) for _, s in cold])
            assert [o.outputs[0].token_ids for o in batch] == list(cold.values())
        assert spec.engine.stats().spec_num_accepted_tokens > 0, "no draft was accepted: nothing was tested"
    finally:
        spec.close()


def test_n_sequences_share_the_prompt_blocks(llm_bf16: LLM) -> None:
    kv = llm_bf16.engine.kv
    prompt = llm_bf16.tokenizer.encode("A long prompt whose blocks the sequences share. " * 8)
    full_blocks = (len(prompt) - 1) // kv.block_size
    hits = kv.prefix_cache_hits
    kv.pool.reset_prefix_cache()
    out = llm_bf16.generate([prompt], SamplingParams(n=4, temperature=1.0, max_tokens=4, seed=1))[0]
    assert len(out.outputs) == 4
    # Sequences 1..3 reuse every full prompt block that sequence 0 computes in the same step.
    assert kv.prefix_cache_hits - hits == 3 * full_blocks * kv.block_size


def test_timestamps(llm_bf16: LLM) -> None:
    out = llm_bf16.generate("Hello", SamplingParams(temperature=0, max_tokens=6, ignore_eos=True))[0].outputs[
        0
    ]
    m = out.metrics
    assert m.arrival_time <= m.first_scheduled_time <= m.first_token_time <= m.finished_time
    assert len(m.token_times) == 6 and m.token_times == sorted(m.token_times)
    assert m.ttft is not None and m.ttft >= 0


def test_abort_frees_blocks(llm_bf16: LLM) -> None:
    eng = llm_bf16.engine
    free = eng.kv.pool.num_free
    eng.add_request(
        EngineRequest("abort-me", llm_bf16.tokenizer.encode("word " * 100), SamplingParams(max_tokens=50))
    )
    eng.step()
    eng.step()
    assert eng.kv.pool.num_free < free
    outs = eng.abort(["abort-me"])
    assert outs[0].finish_reason.value == "abort"
    assert eng.kv.pool.num_free == free and not eng.has_unfinished()


def test_cache_salt_isolates(llm_bf16: LLM) -> None:
    eng = llm_bf16.engine
    prompt = "A long shared system prompt about tenants. " * 10
    llm_bf16.generate(prompt, GREEDY, cache_salt="tenant-a")
    a = llm_bf16.generate(prompt, GREEDY, cache_salt="tenant-a")[0]
    b = llm_bf16.generate(prompt, GREEDY, cache_salt="tenant-b")[0]
    assert a.num_cached_tokens > 0 and b.num_cached_tokens == 0
    assert eng.kv.prefix_cache_queries >= eng.kv.prefix_cache_hits > 0


def test_priority_argument(llm_bf16: LLM) -> None:
    outs = llm_bf16.generate(["a", "b"], GREEDY, priority=[1, 0])
    assert len(outs) == 2


@pytest.mark.parametrize(
    ("prompt", "message"),
    [("", "empty"), ([999999], "out of range"), ("word " * 2000, "context length")],
)
def test_bad_prompts(llm_bf16: LLM, prompt, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        llm_bf16.generate(["fine", prompt], GREEDY)
    assert not llm_bf16.engine.has_unfinished(), "a rejected batch must not leave requests behind"


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"temperature": -1}, "temperature"),
        ({"top_p": 0}, "top_p"),
        ({"max_tokens": -1}, "max_tokens"),  # 0 is valid: the prompt is read (and scored), nothing made
        ({"n": 0}, "n"),
        ({"min_tokens": 5, "max_tokens": 2}, "min_tokens"),
        ({"logprobs": 50}, "logprobs"),
    ],
)
def test_bad_sampling_params(kwargs, field: str) -> None:
    with pytest.raises(ValueError, match=field):
        SamplingParams(**kwargs)


def test_streaming_deltas_join_to_the_full_text(llm_bf16: LLM) -> None:
    from tokenmill.frontend.stream import stream_ids

    p = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    prompt = llm_bf16.tokenizer.encode("Write a short poem about the sea:")
    deltas = list(stream_ids(llm_bf16, prompt, p))
    assert len(deltas) > 3
    assert "".join(deltas) == llm_bf16.generate([prompt], p)[0].outputs[0].text
    assert not llm_bf16.engine.has_unfinished()
