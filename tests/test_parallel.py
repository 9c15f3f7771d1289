"""Tensor and pipeline parallelism: how a model is cut, and the cut model against one process.

The integration tests start real rank processes joined by torch.distributed (gloo) and compare, in
float32, greedy tokens (identical) and logprobs (within 1e-4: the ranks sum partial products in a
different order than one matmul does) with the same engine in one process.
"""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import pytest
import torch

from tokenmill import LLM, SamplingParams
from tokenmill.models.config import ModelConfig
from tokenmill.models.linear import int8_matmuls_available
from tokenmill.models.llama import LlamaForCausalLM, _skip_init, shard_weights
from tokenmill.models.parallel import Shard, split_range
from tokenmill.models.rope import RotaryEmbedding
from tokenmill.worker.executor import WorkerDiedError

SMOL = ModelConfig("llama", 49152, 576, 1536, 30, 9, 3, 64, tie_word_embeddings=True)


def test_split_range_is_near_even_and_complete() -> None:
    parts = [split_range(10, 3, i) for i in range(3)]
    assert [len(p) for p in parts] == [3, 3, 4]
    assert sum((list(p) for p in parts), []) == list(range(10))
    with pytest.raises(ValueError, match="non-empty"):
        split_range(2, 3, 0)


def test_heads_split_by_whole_groups_even_when_uneven() -> None:
    # SmolLM2: 9 query heads in 3 groups of 3; two ranks hold 1 and 2 whole groups.
    a, b = Shard.of(SMOL, 2, 0, 1, 0), Shard.of(SMOL, 2, 1, 1, 0)
    assert (a.kv_heads, a.q_heads) == (range(0, 1), range(0, 3))
    assert (b.kv_heads, b.q_heads) == (range(1, 3), range(3, 9))
    assert len(a.intermediate) + len(b.intermediate) == 1536


def test_more_ranks_than_kv_heads_replicate_them() -> None:
    shards = [Shard.of(SMOL, 6, r, 1, 0) for r in range(6)]
    assert [s.kv_heads for s in shards] == [range(h, h + 1) for h in (0, 0, 1, 1, 2, 2)]
    q = [list(s.q_heads) for s in shards]
    assert sum(q, []) == list(range(9))  # every query head exactly once, next to its own kv head
    assert all(set(s.q_heads) <= set(range(s.kv_heads.start * 3, s.kv_heads.stop * 3)) for s in shards)
    with pytest.raises(ValueError, match="not a multiple"):
        Shard.of(SMOL, 4, 0, 1, 0)
    with pytest.raises(ValueError, match="exceeds the 30 layers"):
        Shard.of(SMOL, 1, 0, 31, 0)


def test_shards_put_back_together_are_the_model() -> None:
    cfg = ModelConfig("qwen2", 50, 16, 24, 4, 4, 2, 4, attention_bias=True)
    g = torch.Generator().manual_seed(0)

    def rnd(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=g)

    sd = {"embed_tokens.weight": rnd(50, 16), "norm.weight": rnd(16), "lm_head.weight": rnd(50, 16)}
    for i in range(4):
        sd |= {
            f"layers.{i}.self_attn.qkv_proj.weight": rnd(32, 16),
            f"layers.{i}.self_attn.qkv_proj.bias": rnd(32),
            f"layers.{i}.self_attn.o_proj.weight": rnd(16, 16),
            f"layers.{i}.mlp.gate_up_proj.weight": rnd(48, 16),
            f"layers.{i}.mlp.down_proj.weight": rnd(16, 24),
            f"layers.{i}.input_layernorm.weight": rnd(16),
            f"layers.{i}.post_attention_layernorm.weight": rnd(16),
        }
    # 2 x 2: stage 1 holds layers 2 and 3 (named 0 and 1), the norm and the head.
    parts = {(t, p): cut(sd, cfg, Shard.of(cfg, 2, t, 2, p)) for t in range(2) for p in range(2)}
    assert "embed_tokens.weight" not in parts[0, 1] and "lm_head.weight" not in parts[0, 0]
    assert torch.equal(
        torch.cat([parts[0, 1]["lm_head.weight"], parts[1, 1]["lm_head.weight"]]), sd["lm_head.weight"]
    )
    assert torch.equal(
        parts[1, 1]["layers.1.mlp.down_proj.weight"], sd["layers.3.mlp.down_proj.weight"][:, 12:]
    )
    # qkv of rank 1: its q heads (2, 3), then its k head (1), then its v head (1), rows of 4.
    w = sd["layers.0.self_attn.qkv_proj.weight"]
    want = torch.cat([w[8:16], w[16 + 4 : 16 + 8], w[24 + 4 : 24 + 8]])
    assert torch.equal(parts[1, 0]["layers.0.self_attn.qkv_proj.weight"], want)
    gu = sd["layers.0.mlp.gate_up_proj.weight"]
    assert torch.equal(parts[0, 0]["layers.0.mlp.gate_up_proj.weight"], torch.cat([gu[:12], gu[24:36]]))
    # The whole model's shard is the state dict itself (no copies).
    whole = cut(sd, cfg, Shard.whole(cfg))
    assert all(whole[k] is sd[k] for k in sd)
    # A row-parallel layer takes no bias (it would be summed once per rank).
    with pytest.raises(ValueError, match="row-parallel"):
        cut({**sd, "layers.0.mlp.down_proj.bias": rnd(16)}, cfg, Shard.of(cfg, 2, 0, 1, 0))


def cut(sd: dict[str, torch.Tensor], cfg: ModelConfig, shard: Shard) -> dict[str, torch.Tensor]:
    """A shard's tensors as build_model loads them: the stage's, and each parallel linear's own cut."""
    with _skip_init(), torch.device("meta"):
        model = LlamaForCausalLM(cfg, RotaryEmbedding(cfg.head_dim, 64, cfg.rope_theta, None, None), shard)
    return shard_weights(model, sd)


# -- the real thing: rank processes over gloo ----------------------------------------------------

PROMPTS = [
    "The capital of France is",
    "Write a short poem about the sea. " * 6,  # longer than the 32-token step budget: chunked prefill
    "def fibonacci(n):",
    "List three colours:",
]
SHARED = "You are a helpful assistant. Answer briefly and precisely, in one sentence. Question: "
FOLLOW_UPS = [SHARED + "what is rain?", SHARED + "what is snow?"]  # prefix-cache hits on the second
PARAMS = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=3)
OPTS = dict(dtype="float32", max_model_len=512, max_num_batched_tokens=32)


def run(llm: LLM) -> list[tuple[list[int], list[float]]]:
    got = []
    for batch in (PROMPTS, FOLLOW_UPS[:1], FOLLOW_UPS[1:]):
        for o in llm.generate(batch, PARAMS):
            c = o.outputs[0]
            got.append((list(c.token_ids), [lp.logprob for lp in c.logprobs]))
    return got


@pytest.fixture(scope="module")
def reference() -> list[tuple[list[int], list[float]]]:
    llm = LLM(**OPTS)
    try:
        return run(llm)
    finally:
        llm.engine.shutdown()


@pytest.mark.slow
@pytest.mark.parametrize(("tp", "pp"), [(2, 1), (1, 2), (2, 2)])
def test_parallel_matches_one_process(tp: int, pp: int, reference) -> None:
    llm = LLM(**OPTS, tensor_parallel_size=tp, pipeline_parallel_size=pp)
    try:
        got = run(llm)
        assert llm.engine.kv.prefix_cache_hits > 0, "the follow-up reused the shared prefix"
    finally:
        llm.engine.shutdown()
    for (tokens, lps), (ref_tokens, ref_lps) in zip(got, reference, strict=True):
        assert tokens == ref_tokens
        assert max(abs(a - b) for a, b in zip(lps, ref_lps, strict=True)) < 1e-4


@pytest.mark.slow
@pytest.mark.parametrize("tp", [2, 4])
def test_tensor_parallel_qwen2_with_biases_against_transformers(tp: int, tmp_path: Path, llm_fp32) -> None:
    # 4 query heads, 2 key/value heads: tp 4 replicates each kv head on two ranks.
    transformers = pytest.importorskip("transformers", reason="transformers is the reference implementation")
    from reference import hf_greedy

    torch.manual_seed(0)
    cfg = transformers.Qwen2Config(
        vocab_size=49152, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=4096, initializer_range=0.2, tie_word_embeddings=True,
    )  # fmt: skip
    hf = transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).eval()
    with torch.no_grad():
        for layer in hf.model.layers:
            for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
                proj.bias.normal_(0, 0.5)
    hf.save_pretrained(tmp_path, safe_serialization=True)
    llm_fp32.tokenizer.save(tmp_path)
    prompt = [int(t) for t in torch.randint(3, 49152, (40,))]
    ref_tokens, ref_lps = hf_greedy(hf, prompt, 10)
    ours = LLM(model=str(tmp_path), dtype="float32", max_model_len=256, tensor_parallel_size=tp)
    try:
        out = ours.generate(
            [prompt], SamplingParams(temperature=0, max_tokens=10, ignore_eos=True, logprobs=3)
        )
    finally:
        ours.engine.shutdown()
    c = out[0].outputs[0]
    assert c.token_ids == ref_tokens
    for lp, ref in zip(c.logprobs, ref_lps, strict=True):
        assert abs(lp.logprob - float(ref[lp.token_id])) < 1e-3


@pytest.mark.slow
def test_int8_pipeline_stages_are_smoothed_as_one_process(tmp_path: Path) -> None:
    """int8's smoothing across two pipeline stages: the second stage calibrates on the first's output,
    so the stages answer as one smoothed process does, bit for bit (an empty cache: both measure). On
    one thread each: a matmul's sums are ordered by how its threads split it, so one process on two
    threads (a stage gets one core of two) measures maxima a few bf16 ulps apart, and answers apart."""
    opts = dict(
        quantization="int8",
        max_model_len=512,
        max_num_batched_tokens=32,
        cache_dir=str(tmp_path),
        num_threads=1,
        adaptive_threads=False,
    )
    results, labels = [], []
    for pp in (1, 2):
        llm = LLM(**opts, pipeline_parallel_size=pp)
        try:
            results.append(run(llm))
            labels.append(llm.engine.info["weights_label"])
        finally:
            llm.engine.shutdown()
    one, stages = results
    assert stages == one
    if int8_matmuls_available(torch.device("cpu")):  # else int8 keeps bf16 weights: nothing to smooth
        assert labels == ["int8-smoothed-0.7"] * 2
        assert len(list(tmp_path.glob("*/int8-maxima-*.safetensors"))) == 3  # the whole model, 2 stages


@pytest.mark.slow
def test_a_dead_rank_ends_the_engine_with_an_error_not_a_hang() -> None:
    llm = LLM(**OPTS, tensor_parallel_size=2)
    try:
        os.kill(llm.engine.executor.procs[1].pid, signal.SIGKILL)
        t0 = time.monotonic()
        with pytest.raises(WorkerDiedError, match="rank 1"):
            llm.generate(["Hello"], SamplingParams(temperature=0, max_tokens=4))
        assert time.monotonic() - t0 < 60
    finally:
        llm.engine.shutdown()


@pytest.mark.slow
def test_serve_with_tensor_parallelism_answers_the_openai_client(reference, llm_fp32) -> None:
    import openai
    from server_fixture import running_server

    args = ("--tensor-parallel-size", "2", "--dtype", "float32", "--max-num-batched-tokens", "32")
    with running_server(*args) as server:
        client = openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="unused", max_retries=0)
        got = client.completions.create(
            model=client.models.list().data[0].id, prompt=PROMPTS[0], max_tokens=12, temperature=0
        )
    ref_tokens, _ = reference[0]
    assert got.choices[0].text == llm_fp32.tokenizer.decode(ref_tokens)
    assert got.usage.completion_tokens == 12
