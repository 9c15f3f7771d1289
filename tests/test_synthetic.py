"""A synthetic GGUF (weights/synthetic.py: a real shape, seeded random weights, the embedded model's
tokenizer) means the same to tokenmill as to Hugging Face transformers' GGUF reader, the independent
reference: the same weights bit for bit, greedy tokens and logprobs equal in float32. The benchmarks
of models bigger than the embedded one stand on this."""

from __future__ import annotations

import hashlib
from pathlib import Path

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType, GGUFReader
from reference import hf_greedy
from weights_caches import drop_weights_caches

from tokenmill import LLM, SamplingParams
from tokenmill.weights import synthetic
from tokenmill.weights.gguf_file import GGUFFile

pytestmark = pytest.mark.slow

# Small enough to load in a second; head_dim 32 and grouped-query attention (4 heads over 2) as the
# family's models have. std 0.3 so that every layer moves the logits (at 0.02 the embedding decides).
TINY = synthetic.Shape("tiny", hidden=128, layers=2, ffn=256, heads=4, kv_heads=2, rope_theta=130000.0)
STD = 0.3
LOGPROB_TOL = 2e-3  # as tests/test_correctness_hf.py: float32, the same math in another order
NEW_TOKENS = 8


@pytest.fixture(scope="module")
def files(model_path: Path, tmp_path_factory):
    out = tmp_path_factory.mktemp("synthetic")
    made = {
        t: synthetic.synthesize(model_path, out / f"tiny-{t}.gguf", TINY, t, seed=7, std=STD)
        for t in ("bf16", "f16", "q8_0", "q4_1")
    }
    yield made
    for path in made.values():
        drop_weights_caches(path)


@pytest.mark.parametrize("type_name", ["bf16", "f16", "q8_0", "q4_1"])
def test_same_weights_and_outputs_as_transformers(files: dict[str, Path], type_name: str) -> None:
    transformers = pytest.importorskip("transformers", reason="transformers is the reference implementation")
    path = files[type_name]
    hf = transformers.AutoModelForCausalLM.from_pretrained(
        str(path.parent), gguf_file=path.name, dtype=torch.float32
    ).eval()
    llm = LLM(model=str(path), dtype="float32", max_model_len=256)

    ours = llm.engine.runner.model.state_dict()
    theirs = hf.state_dict()
    q = ours["layers.1.self_attn.qkv_proj.weight"]
    assert torch.equal(q[:128], theirs["model.layers.1.self_attn.q_proj.weight"])
    assert torch.equal(q[128:192], theirs["model.layers.1.self_attn.k_proj.weight"])
    assert torch.equal(ours["embed_tokens.weight"], theirs["model.embed_tokens.weight"])
    assert torch.equal(ours["layers.0.mlp.down_proj.weight"], theirs["model.layers.0.mlp.down_proj.weight"])

    tok = llm.tokenizer
    prompts = [
        tok.encode_chat([{"role": "user", "content": "What is paged attention?"}]),
        tok.encode("One two"),
    ]
    params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True, logprobs=5)
    for prompt, out in zip(prompts, llm.generate(prompts, params), strict=True):
        ref_tokens, ref_logprobs = hf_greedy(hf, prompt, NEW_TOKENS)
        assert out.outputs[0].token_ids == ref_tokens
        for mine, lp in zip(out.outputs[0].logprobs, ref_logprobs, strict=True):
            for tid, value in mine.top:
                assert abs(value - float(lp[tid])) < LOGPROB_TOL
    assert len(set(ref_tokens)) > 1, "the outputs are one token repeated: the layers did not count"


def test_metadata_and_tokenizer(files: dict[str, Path], model_path: Path) -> None:
    path = files["bf16"]
    gguf = GGUFFile(path)
    assert gguf.architecture == "llama"
    assert int(gguf.arch_value("embedding_length")) == TINY.hidden
    assert int(gguf.arch_value("block_count")) == TINY.layers
    assert int(gguf.arch_value("feed_forward_length")) == TINY.ffn
    assert int(gguf.arch_value("attention.head_count")) == TINY.heads
    assert int(gguf.arch_value("attention.head_count_kv")) == TINY.kv_heads
    assert float(gguf.arch_value("rope.freq_base")) == TINY.rope_theta
    src = GGUFFile(model_path)
    for key in ("tokenizer.ggml.tokens", "tokenizer.ggml.merges", "tokenizer.chat_template"):
        assert gguf.metadata[key] == src.metadata[key], key
    n = sum(int(t.n_elements) for t in GGUFReader(path).tensors)
    assert n == TINY.parameters(len(src.metadata["tokenizer.ggml.tokens"]))


def test_seeded_by_name(model_path: Path, files: dict[str, Path], tmp_path: Path) -> None:
    def digest(p: Path) -> str:
        return hashlib.sha256(p.read_bytes()).hexdigest()

    again = synthetic.synthesize(model_path, tmp_path / "again.gguf", TINY, "q8_0", seed=7, std=STD)
    other = synthetic.synthesize(model_path, tmp_path / "other.gguf", TINY, "q8_0", seed=8, std=STD)
    assert digest(again) == digest(files["q8_0"])
    assert digest(other) != digest(files["q8_0"])
    # One more layer leaves the others' values as they were: each tensor's seed is its own name.
    deeper = synthetic.Shape("tiny", 128, 3, 256, 4, 2, rope_theta=130000.0)
    three = synthetic.synthesize(model_path, tmp_path / "deeper.gguf", deeper, "q8_0", seed=7, std=STD)
    a = {t.name: bytes(t.data) for t in GGUFReader(files["q8_0"]).tensors}
    b = {t.name: bytes(t.data) for t in GGUFReader(three).tensors}
    assert all(a[k] == b[k] for k in a)


def test_a_wider_head_as_llama_cpps_quantizer_keeps_it(model_path: Path, tmp_path: Path) -> None:
    """head_type: the embedding (here the tied head) in its own type, every other matrix in the file's;
    the values are the same draws, quantized in each type."""
    path = synthetic.synthesize(model_path, tmp_path / "h.gguf", TINY, "q4_0", seed=7, head_type="q8_0")
    assert path.name == "h.gguf"
    types = {t.name: GGMLQuantizationType(t.tensor_type) for t in GGUFReader(path).tensors}
    assert types["token_embd.weight"] == GGMLQuantizationType.Q8_0
    matrices = {n: t for n, t in types.items() if n.startswith("blk.") and t != GGMLQuantizationType.F32}
    assert matrices and set(matrices.values()) == {GGMLQuantizationType.Q4_0}
    same = synthetic.synthesize(model_path, tmp_path / "s.gguf", TINY, "q8_0", seed=7)
    embd = "token_embd.weight"
    assert np.array_equal(GGUFFile(path).tensor(embd), GGUFFile(same).tensor(embd))
    named = synthetic.default_path(TINY, "q4_0", 7, tmp_path, "q8_0")
    assert named.name == "tiny-random7-q4_0-head-q8_0.gguf"
    assert synthetic.default_path(TINY, "q4_0", 7, tmp_path, "q4_0").name == "tiny-random7-q4_0.gguf"


def test_bad_arguments(model_path: Path, tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="unknown type"):
        synthetic.synthesize(model_path, tmp_path / "x.gguf", TINY, "q3_k")
    with pytest.raises(ValueError, match="unknown type"):
        synthetic.synthesize(model_path, tmp_path / "x.gguf", TINY, "q4_0", head_type="q6_k")
    with pytest.raises(ValueError, match="not a multiple"):
        synthetic.synthesize(model_path, tmp_path / "x.gguf", synthetic.Shape("odd", 100, 1, 64, 3, 1))
    assert not list(tmp_path.iterdir())
