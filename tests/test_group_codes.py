"""A GGUF file's own codes (weights/group_codes.py), 4-bit and Q8_0: decoded as the gguf package
dequantizes them, fused and cut as the weights are, cached (4-bit), and taken as they are by an int4
layer and by int8's group form."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q
from gguf import GGUFWriter
from gguf.constants import GGML_QUANT_SIZES
from gguf.quants import dequantize, quantize
from torch import nn

from tokenmill.models import registry
from tokenmill.models.config import ModelConfig
from tokenmill.models.linear import GroupInt8Linear, QuantizedLinear
from tokenmill.models.llama import LlamaForCausalLM, _skip_init, shard_weights
from tokenmill.models.parallel import Shard
from tokenmill.models.parallel_linear import RowParallelLinear
from tokenmill.models.quant import QuantConfig
from tokenmill.models.quant.codes import shard_codes
from tokenmill.models.rope import RotaryEmbedding
from tokenmill.tokenizer.tokenizer import Tokenizer
from tokenmill.weights import loader
from tokenmill.weights.gguf_file import GGUFFile
from tokenmill.weights.group_codes import (
    Codes,
    codes_from_blocks,
    int8_groups_from_blocks,
    quantize_groups,
    quantize_int8_groups,
)
from tokenmill.weights.requantize import requantize

LLAMA = registry.layout("llama")  # the Llama family's layout of a checkpoint
N, K = 8, 512


def _blocks(qtype: Q, rng: np.random.Generator) -> np.ndarray:
    if qtype != Q.Q4_K:
        return quantize(rng.standard_normal((N, K)).astype(np.float32), qtype)
    # gguf cannot make Q4_K blocks: random ones, with the float16 d and dmin kept finite (no all-ones
    # exponent: bit 2 of their high bytes cleared).
    block, size = GGML_QUANT_SIZES[qtype]
    raw = rng.integers(0, 256, size=(N, K // block, size), dtype=np.uint8)
    raw[..., 1] &= 0xFB
    raw[..., 3] &= 0xFB
    return raw.reshape(N, -1)


@pytest.mark.parametrize("qtype", [Q.Q4_0, Q.Q4_1, Q.Q4_K])
def test_codes_stand_for_exactly_what_gguf_dequantizes(qtype: Q) -> None:
    raw = _blocks(qtype, np.random.default_rng(int(qtype)))
    g = codes_from_blocks(raw, qtype, N, K)
    assert g.q.dtype == torch.uint8 and int(g.q.max()) <= 15 and g.scale.shape == (N, K // 32)
    np.testing.assert_array_equal(g.dequantize().numpy(), dequantize(raw, qtype).reshape(N, K))


def test_q8_0_codes_stand_for_exactly_what_gguf_dequantizes() -> None:
    x = np.random.default_rng(3).standard_normal((N, K)).astype(np.float32)
    x[0, :32] = 0  # a group of zeros: scale 0
    raw = quantize(x, Q.Q8_0)
    g = int8_groups_from_blocks(raw, N, K)
    assert g.q.dtype == torch.int8 and g.scale.shape == (N, K // 32) and g.shape == (N, K)
    np.testing.assert_array_equal(g.dequantize().numpy(), dequantize(raw, Q.Q8_0).reshape(N, K))
    # Quantized again from those values, the groups come back to the file's own codes and scales.
    again = quantize_int8_groups(g.dequantize())
    assert torch.equal(again.q, g.q) and torch.equal(again.scale, g.scale)
    with pytest.raises(ValueError, match="multiple of 32"):
        quantize_int8_groups(torch.randn(4, 48))


def test_only_4bit_tensors_have_codes(tmp_path: Path) -> None:
    x = np.random.default_rng(0).standard_normal((N, K)).astype(np.float32)
    path = tmp_path / "two.gguf"
    w = GGUFWriter(str(path), "llama")
    for qtype in (Q.Q4_1, Q.Q8_0):
        w.add_tensor(qtype.name, quantize(x, qtype), raw_dtype=qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    f = GGUFFile(path)
    assert f.group_codes("Q8_0") is None and f.int8_groups("Q4_1") is None
    g = f.group_codes("Q4_1")
    assert g is not None and np.array_equal(g.dequantize().numpy(), f.tensor("Q4_1"))
    h = f.int8_groups("Q8_0")
    assert h is not None and np.array_equal(h.dequantize().numpy(), f.tensor("Q8_0"))


@pytest.mark.slow
def test_embedded_files_codes_are_its_weights_fused_and_cached(model_path: Path, tmp_path: Path) -> None:
    codes = registry.checkpoint_codes(model_path, tmp_path).int4()
    assert codes is not None
    loaded = registry.load_checkpoint(model_path, torch.float32, tmp_path)
    linears = {k.removesuffix(".weight") for k in loaded.state_dict if k.endswith("_proj.weight")}
    assert set(codes) == linears  # q/k/v and gate/up fused as the weights are
    for name, g in codes.items():
        # Unpermuted (q, k), fused and decoded, the codes are the dequantized file, bit for bit.
        assert torch.equal(g.dequantize(), loaded.state_dict[f"{name}.weight"]), name
    assert len(list(tmp_path.glob("*/int4-codes-*/*/codes-done"))) == 1
    again = registry.checkpoint_codes(model_path, tmp_path).int4()  # from the cache
    assert again is not None and again.keys() == codes.keys()
    for name, g in codes.items():
        h = again[name]
        assert torch.equal(h.nibbles, g.nibbles) and torch.equal(h.scale, g.scale) and torch.equal(h.lo, g.lo)
    assert loader.load_group_codes(tmp_path, LLAMA, tmp_path) is None  # an HF directory: none


@pytest.mark.slow
def test_a_q8_0_files_codes_are_its_weights_fused(
    model_path: Path, q8_0_model_path: Path, tmp_path: Path
) -> None:
    """weights/requantize.py's Q8_0 file of the embedded model: its linears' codes, unpermuted and fused
    as the weights are, decode to the weights the file loads as, bit for bit, and come back the same
    from the cache; its metadata and tokenizer are the embedded file's."""
    assert GGUFFile(q8_0_model_path).int8_groups("blk.0.attn_q.weight") is not None
    codes = registry.checkpoint_codes(q8_0_model_path, tmp_path).int8()
    assert codes is not None
    loaded = registry.load_checkpoint(q8_0_model_path, torch.float32, tmp_path)
    linears = {k.removesuffix(".weight") for k in loaded.state_dict if k.endswith("_proj.weight")}
    assert set(codes) == linears | {"lm_head"}
    # The head is tied: its codes are the embedding's own Q8_0 blocks.
    assert "lm_head.weight" not in loaded.state_dict
    head = GGUFFile(q8_0_model_path).int8_groups("token_embd.weight")
    assert head is not None
    assert torch.equal(codes["lm_head"].q, head.q) and torch.equal(codes["lm_head"].scale, head.scale)
    loaded.state_dict["lm_head.weight"] = loaded.state_dict["embed_tokens.weight"]
    for name, g in codes.items():
        assert torch.equal(g.dequantize(), loaded.state_dict[f"{name}.weight"]), name
    assert loader.read_hf_config(q8_0_model_path) == loader.read_hf_config(model_path)
    original = Tokenizer.from_gguf_metadata(GGUFFile(model_path).metadata)
    text = "The capital of France"
    assert loaded.tokenizer.encode_text(text) == original.encode_text(text)
    again = registry.checkpoint_codes(q8_0_model_path, tmp_path).int8()  # from the cache
    assert again is not None and again.keys() == codes.keys()
    assert all(
        torch.equal(again[n].q, g.q) and torch.equal(again[n].scale, g.scale) for n, g in codes.items()
    )
    assert registry.checkpoint_codes(model_path, tmp_path).int8() is None  # a Q4_1 file has no Q8_0 linears
    done = sorted(p.read_text() for p in tmp_path.glob("*/int8-codes-*/*/codes-done"))
    assert done == ["codes\n", "none\n"]  # both remembered: a later start parses neither file
    assert loader.load_int8_groups(tmp_path, LLAMA, tmp_path) is None  # an HF directory: none


@pytest.mark.parametrize("own", [True, False], ids=["Q8_0 head", "head of another type"])
def test_an_untied_heads_codes_are_output_weights(
    model_path: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, own: bool
) -> None:
    """A file with its own output.weight: the head's codes are that tensor's Q8_0 blocks, or, where it
    has none (another type), its float32 values quantized into groups; either way they stand for the
    values the file loads for the head."""
    from tokenmill.weights import synthetic

    shape = synthetic.Shape("untied", hidden=64, layers=1, ffn=128, heads=2, kv_heads=1, tied=False)
    path = synthetic.synthesize(model_path, tmp_path / "untied-q8_0.gguf", shape, "q8_0", seed=3)
    f = GGUFFile(path)
    if not own:  # as if output.weight were of a type without 8-bit codes
        take = GGUFFile.int8_groups
        none_for_head = lambda g, n: take(g, n) if n != "output.weight" else None  # noqa: E731
        monkeypatch.setattr(GGUFFile, "int8_groups", none_for_head)
    codes = loader.load_int8_groups(path, LLAMA, tmp_path)
    assert codes is not None
    head = codes["lm_head"]
    assert np.array_equal(head.dequantize().numpy(), f.tensor("output.weight"))
    if own:
        given = f.int8_groups("output.weight")
        assert given is not None and torch.equal(head.q, given.q) and torch.equal(head.scale, given.scale)
    assert not np.array_equal(f.tensor("output.weight"), f.tensor("token_embd.weight"))  # not the embedding


@pytest.mark.parametrize("head_type", [None, "q8_0"], ids=["pure Q4_0", "Q8_0 head"])
def test_a_4bit_files_head_computes_with_its_own_codes(
    model_path: Path, tmp_path: Path, head_type: str | None
) -> None:
    """A file that keeps its (tied) output head in Q4_0 like its layers, as `llama-quantize --pure`
    writes it: the 4-bit codes hold the embedding's own blocks as "lm_head", and an int4 model's head
    takes them (4 bits, the file's weights exactly) rather than an 8-bit copy of their values; a head of
    another type gives no 4-bit codes and stays at 8 bits: a Q8_0 head's own blocks in the group panels
    where they run (the checkpoint's codes, as the worker passes them), else per channel."""
    from tokenmill.weights import synthetic

    shape = synthetic.Shape("pure", hidden=64, layers=1, ffn=128, heads=2, kv_heads=1)
    path = synthetic.synthesize(model_path, tmp_path / "q4.gguf", shape, "q4_0", seed=4, head_type=head_type)
    codes = registry.checkpoint_codes(path, tmp_path).int4()
    assert codes is not None and any(n.endswith("qkv_proj") for n in codes)
    f = GGUFFile(path)
    if head_type is None:
        own = f.group_codes("token_embd.weight")
        assert own is not None
        head = codes["lm_head"]
        assert torch.equal(head.nibbles, own.nibbles) and torch.equal(head.scale, own.scale)
        assert np.array_equal(head.dequantize().numpy(), f.tensor("token_embd.weight"))
    else:
        assert "lm_head" not in codes
    loaded = registry.load_checkpoint(path, torch.bfloat16, tmp_path)
    model = registry.build(
        loaded.config, loaded.state_dict, torch.bfloat16, torch.device("cpu"), 64,
        quant=QuantConfig("int4", codes=registry.checkpoint_codes(path, tmp_path)),
    )  # fmt: skip
    lm_head = model.lm_head
    if head_type is not None and model.ops.group_panels_available():
        from tokenmill.models.linear import GroupInt8Linear
        from tokenmill.models.ops import g8_pack

        blocks = f.int8_groups("token_embd.weight")
        assert isinstance(lm_head, GroupInt8Linear) and blocks is not None
        assert torch.equal(lm_head.kernel.panels, g8_pack(blocks.q, blocks.scale))
    else:
        assert isinstance(lm_head, QuantizedLinear)
        assert (lm_head.bits, lm_head.from_codes) == ((4, True) if head_type is None else (8, False))
    # Whatever kernel runs here (2 rows: bf16 activations), the head computes with the file's weights:
    # within the output's bf16 rounding and the weights' (PyTorch's int4 and int8 kernels hold their
    # scales in bf16), and for 8 bits a rounding of each weight to its row's 255 levels.
    x = torch.randn(2, shape.hidden, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16)
    w = torch.from_numpy(f.tensor("token_embd.weight")).double()
    exact = x.double() @ w.T
    with torch.inference_mode():
        out = lm_head(x).double()
    tolerance = 2**-8 * (exact.abs() + x.double().abs() @ w.abs().T)
    if isinstance(lm_head, QuantizedLinear) and head_type is not None:  # per channel: a second rounding
        tolerance += x.double().abs().sum(-1, keepdim=True) * w.abs().amax(1) / 254
    assert bool(((out - exact).abs() <= tolerance).all())


def test_requantize_writes_every_quantized_matrix_in_the_new_type(tmp_path: Path) -> None:
    x = np.random.default_rng(4).standard_normal((N, K)).astype(np.float32)
    src = tmp_path / "src.gguf"
    w = GGUFWriter(str(src), "llama")
    w.add_uint32("llama.block_count", 1)
    w.add_tensor("q4", quantize(x, Q.Q4_1), raw_dtype=Q.Q4_1)
    w.add_tensor("f32", x[0])
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    out = GGUFFile(requantize(src, tmp_path / "out.gguf"))
    assert out.metadata["llama.block_count"] == 1
    h = out.int8_groups("q4")
    assert h is not None
    np.testing.assert_array_equal(
        h.dequantize().numpy(), dequantize(quantize(GGUFFile(src).tensor("q4"), Q.Q8_0), Q.Q8_0)
    )
    np.testing.assert_array_equal(out.tensor("f32"), x[0])
    assert not list(tmp_path.glob("*.tmp"))


def test_an_int8_group_layer_takes_given_codes_as_they_are() -> None:
    g = quantize_int8_groups(torch.randn(64, 96, generator=torch.Generator().manual_seed(0)))
    lin = nn.Linear(96, 64, bias=False)
    lin.weight = nn.Parameter(torch.zeros(64, 96, dtype=torch.bfloat16), requires_grad=False)
    seen = []

    def group_for(q, scale):  # records what it was given; the layer then computes with this kernel
        seen.append((q, scale))
        return lambda x: torch.ones(x.shape[0], 64, dtype=x.dtype)

    layer = GroupInt8Linear.of(lin, group_for, g)
    assert layer is not None and layer(torch.zeros(3, 96, dtype=torch.bfloat16)).shape == (3, 64)
    ((q, scale),) = seen
    assert torch.equal(q, g.q) and torch.equal(scale, g.scale)
    assert GroupInt8Linear.of(lin, lambda q, s: None, g) is None  # no kernel for it: not this form
    with pytest.raises(ValueError, match="do not fit"):
        GroupInt8Linear.of(lin, group_for, quantize_int8_groups(torch.randn(64, 64)))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_4bit_layer_takes_given_codes_as_they_are(dtype: torch.dtype) -> None:
    g = quantize_groups(torch.randn(64, 96, generator=torch.Generator().manual_seed(0)))
    lin = nn.Linear(96, 64, bias=False)
    # The layer's own weight is something else: only the codes may decide what it computes.
    lin.weight = nn.Parameter(torch.zeros(64, 96, dtype=dtype), requires_grad=False)
    seen = []

    def quant_for(bits, q, scale, lo):  # PyTorch's kernels then, after recording what it was given
        seen.append((q, scale, lo))
        return None

    layer = QuantizedLinear(lin, 4, 4, quant_for, codes=g)
    assert layer.from_codes
    (q, scale, lo), *_ = seen
    assert torch.equal(q, g.q) and torch.equal(scale, g.scale) and torch.equal(lo, g.lo)
    # The copy for larger steps holds the codes' weights (bf16's is in oneDNN's layout where it packs).
    copy = getattr(layer.wide, "weight", None)
    if copy is not None:
        assert torch.equal(copy, g.dequantize().to(dtype))
    with pytest.raises(ValueError, match="do not fit"):
        QuantizedLinear(lin, 4, 4, codes=quantize_groups(torch.randn(64, 64)))


def _config(intermediate: int) -> ModelConfig:
    return ModelConfig("llama", 50, 64, intermediate, 4, 4, 2, 16)


def _codes_and_weights(
    cfg: ModelConfig, quantizer=quantize_groups
) -> tuple[dict[str, Codes], dict[str, torch.Tensor]]:
    gen = torch.Generator().manual_seed(1)
    shapes = {
        "self_attn.qkv_proj": (cfg.head_dim * (cfg.num_heads + 2 * cfg.num_kv_heads), cfg.hidden_size),
        "self_attn.o_proj": (cfg.hidden_size, cfg.head_dim * cfg.num_heads),
        "mlp.gate_up_proj": (2 * cfg.intermediate_size, cfg.hidden_size),
        "mlp.down_proj": (cfg.hidden_size, cfg.intermediate_size),
    }
    codes = {
        f"layers.{i}.{name}": quantizer(torch.randn(*shape, generator=gen))
        for i in range(cfg.num_layers)
        for name, shape in shapes.items()
    }
    weights = {f"{name}.weight": g.dequantize() for name, g in codes.items()}
    for i in range(cfg.num_layers):
        weights[f"layers.{i}.input_layernorm.weight"] = torch.ones(cfg.hidden_size)
        weights[f"layers.{i}.post_attention_layernorm.weight"] = torch.ones(cfg.hidden_size)
    weights["embed_tokens.weight"] = torch.zeros(cfg.vocab_size, cfg.hidden_size)
    codes["lm_head"] = quantizer(torch.randn(cfg.vocab_size, cfg.hidden_size, generator=gen))
    weights["lm_head.weight"] = codes["lm_head"].dequantize()
    weights["norm.weight"] = torch.ones(cfg.hidden_size)
    return codes, weights


def _model(cfg: ModelConfig, shard: Shard) -> LlamaForCausalLM:
    with _skip_init(), torch.device("meta"):
        return LlamaForCausalLM(cfg, RotaryEmbedding(cfg.head_dim, 64, cfg.rope_theta, None, None), shard)


@pytest.mark.parametrize("quantizer", [quantize_groups, quantize_int8_groups], ids=["4-bit", "Q8_0"])
@pytest.mark.parametrize(("tp", "pp"), [(1, 1), (2, 1), (2, 2), (1, 2)])
def test_shards_codes_are_cut_as_their_weights_are(tp: int, pp: int, quantizer) -> None:
    cfg = _config(intermediate=128)
    codes, weights = _codes_and_weights(cfg, quantizer)
    for rank in range(tp):
        for stage in range(pp):
            model = _model(cfg, Shard.of(cfg, tp, rank, pp, stage))
            part, cut = shard_codes(model, codes), shard_weights(model, weights)
            # The head's codes on the last stage only, cut to the rank's vocabulary rows as its weight is.
            linears = {k for k in cut if k.endswith("_proj.weight") or k == "lm_head.weight"}
            assert {f"{n}.weight" for n in part} == linears
            assert ("lm_head" in part) == (stage == pp - 1)
            for name, g in part.items():
                assert torch.equal(g.dequantize(), cut[f"{name}.weight"]), (rank, stage, name)


@pytest.mark.parametrize("quantizer", [quantize_groups, quantize_int8_groups], ids=["4-bit", "Q8_0"])
def test_a_cut_through_a_group_leaves_that_layer_to_be_quantized(quantizer) -> None:
    cfg = _config(intermediate=96)  # two ranks' down_proj columns split at 48, inside a group of 32
    codes, weights = _codes_and_weights(cfg, quantizer)
    model = _model(cfg, Shard.of(cfg, 2, 1, 1, 0))
    part = shard_codes(model, codes)
    assert isinstance(model.get_submodule("layers.0.mlp.down_proj"), RowParallelLinear)
    assert "layers.0.mlp.down_proj" not in part and "layers.0.self_attn.o_proj" in part
