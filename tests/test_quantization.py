"""Weight-only quantized linears: the 4-bit path reproduces a Q4_1 GGUF tensor; both paths agree."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn

from tokenmill import LLM, SamplingParams
from tokenmill.models.linear import GroupInt8Linear, QuantizedLinear
from tokenmill.quality.fidelity import compare, forced_run
from tokenmill.quality.prompts import chat_prompts
from tokenmill.weights.gguf_file import GGUFFile


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_small_and_large_batch_paths_agree(bits: int, dtype: torch.dtype) -> None:
    torch.manual_seed(0)
    lin = nn.Linear(576, 192, bias=True).to(dtype)
    q = QuantizedLinear(lin, bits=bits, max_rows=4)
    x = torch.randn(8, 576).to(dtype)
    small = torch.cat([q(x[i : i + 2]) for i in range(0, 8, 2)])  # 2 rows: the quantized kernel
    large = q(x)  # 8 rows: the dequantized twin
    tol = 1e-4 if dtype == torch.float32 else 0.1
    torch.testing.assert_close(small.float(), large.float(), atol=tol, rtol=tol)
    # And the quantization error against the original weights is what the bit width allows.
    err = (large.float() - lin(x).float()).abs().max()
    assert err < (0.05 if bits == 8 else 0.3)


@pytest.mark.parametrize("bits", [4, 8])
def test_panel_kernels_agree_with_pytorchs_quantized_matmuls(bits: int) -> None:
    """Where the ops give quantized layers their panel kernels (AVX512-BF16 without AMX), they answer as
    PyTorch's int4/int8 matmuls over the same codes do, and as the layer's dequantized twin, within bf16."""
    from tokenmill.models.ops import get_ops

    ops = get_ops("cpu", "cpu")
    torch.manual_seed(0)
    lin = nn.Linear(576, 1536, bias=True).to(torch.bfloat16)
    fast = QuantizedLinear(lin, bits=bits, max_rows=4, quant_for=ops.quantized_matmul_for)
    if fast.small is None:
        pytest.skip("no panel kernel for quantized layers on this CPU (needs AVX512-BF16, used without AMX)")
    ref = QuantizedLinear(lin, bits=bits, max_rows=4)
    for rows in (1, 2, 3, 4):
        x = torch.randn(rows, 576).to(torch.bfloat16)
        a, b, wide = fast(x).float(), ref(x).float(), ref.wide(x).float()
        scale = float(wide.abs().max())
        gaps = float((a - wide).abs().max()) / scale, float((a - b).abs().max()) / scale
        assert max(gaps) <= 2**-6, (rows, gaps)


@pytest.mark.parametrize(
    ("bits", "int8_activations", "bound"), [(4, False, 2**-6), (4, True, 2**-5), (8, False, 2**-6)]
)
def test_the_panels_take_every_step_and_the_layer_keeps_no_bf16_copy(
    bits: int, int8_activations: bool, bound: float
) -> None:
    """Where the panels run, a bf16 layer sends steps of any size to them and holds no dequantized copy.
    4 bits: with bf16 activations its answers stay within bf16 rounding of the copy's (measured 0.4-0.8%
    of the largest output), with int8 activations above 2 rows within their rounding too (0.6-0.75%;
    1.0-1.1% before the minimum's term took the rounded activations' sums).
    8 bits (int4's per-channel output head; each panel dequantized to bf16 above 4 rows): within bf16
    rounding of the copy's (the kernel's column scales are bf16, the copy's float32)."""
    import functools

    from tokenmill.models.ops import get_ops

    ops = get_ops("cpu", "cpu")
    torch.manual_seed(0)
    lin = nn.Linear(576, 1536, bias=True).to(torch.bfloat16)
    quant_for = functools.partial(ops.quantized_matmul_for, int8_activations=int8_activations)
    fast = QuantizedLinear(lin, bits=bits, max_rows=4, quant_for=quant_for)
    if fast.small is None:
        pytest.skip(f"no {bits}-bit panel kernel on this CPU (needs AVX512-BF16, used without AMX)")
    assert fast.max_rows is None and fast.wide is None
    ref = QuantizedLinear(lin, bits=bits, max_rows=4)
    for rows in (5, 64, 300):
        x = torch.randn(rows, 576).to(torch.bfloat16)
        a, wide = fast(x).float(), ref.wide(x).float()
        gap = float((a - wide).abs().max()) / float(wide.abs().max())
        assert gap <= bound, (rows, gap)


@pytest.mark.parametrize("rows", [5, 32, 256])
def test_the_bf16_copy_takes_the_few_row_kernel_above_max_rows(rows: int) -> None:
    """Above max_rows a quantized layer runs its dequantized bf16 copy; given `small_for`, that copy has
    the bf16 model's few-row kernel (panel matmul) too, and answers as its plain matmul does within bf16
    rounding of float64."""
    from tokenmill.models.linear import PackedLinear, takes
    from tokenmill.models.ops import get_ops

    ops = get_ops("cpu", "cpu")
    torch.manual_seed(rows)
    lin = nn.Linear(576, 1536, bias=False).to(torch.bfloat16)
    q = QuantizedLinear(lin, bits=4, max_rows=4, small_for=ops.small_matmul_for)
    if not isinstance(q.wide, PackedLinear):
        pytest.skip("no oneDNN packing here: the copy is a plain linear")
    kernel = q.wide.small
    if kernel is None or not takes(kernel.max_rows, rows):
        pytest.skip(f"no few-row kernel for {rows} rows on this CPU")
    # The copy's weights, read back with an identity (exact whichever matmul of the copy takes 576 rows).
    w = q.wide(torch.eye(576, dtype=torch.bfloat16)).t().double()
    x = torch.randn(rows, 576).to(torch.bfloat16)
    exact = x.double() @ w.t()
    y = q(x)
    assert torch.equal(y, kernel(x))  # the copy's kernel, not oneDNN, computed it
    magnitude = x.double().abs() @ w.abs().t()
    assert bool(((y.double() - exact).abs() <= 2**-8 * 1.02 * exact.abs() + 576 * 2**-23 * magnitude).all())


def test_int4_activations_setting_is_checked() -> None:
    from tokenmill.config import EngineConfig

    assert EngineConfig().int4_activations == "int8"  # W4A8 above 2 rows, as llama.cpp; bf16 if asked
    with pytest.raises(ValueError, match="int4_activations"):
        EngineConfig(quantization="int4", int4_activations="fp8")


def test_q4_1_tensor_is_recovered_exactly(model_path: Path) -> None:
    w = torch.from_numpy(GGUFFile(model_path).tensor("blk.0.ffn_up.weight"))  # a Q4_1 tensor
    lin = nn.Linear(w.shape[1], w.shape[0], bias=False)
    lin.weight = nn.Parameter(w)
    q = QuantizedLinear(lin, bits=4, max_rows=4)
    torch.testing.assert_close(q.wide.weight, w, atol=1e-6, rtol=1e-6)


@pytest.mark.slow
def test_int4_engine_generates_like_bf16() -> None:
    # Not token-identical (other weights' rounding), so compare next-token predictions along the bf16
    # model's own greedy continuations (teacher forcing, tokenmill/quality/fidelity.py) over 16 chat
    # prompts: one near-tie cannot derail the comparison, as it would between free-running generations.
    common = {"max_model_len": 512, "kv_cache_memory_gb": 0.1, "enable_prefix_caching": False}
    bf16 = LLM(**common)
    prompts = chat_prompts(bf16.tokenizer)
    ref = forced_run(bf16, prompts, 24)
    del bf16
    int4 = LLM(quantization="int4", **common)
    # The embedded file is Q4_1: every 4-bit layer computes with the file's own codes; the head is 8-bit.
    model = int4.engine.executor.worker.model
    four_bit = [m for m in model.modules() if isinstance(m, QuantizedLinear) and m.bits == 4]
    assert all(m.from_codes for m in four_bit) and len(four_bit) == 120
    assert isinstance(model.lm_head, GroupInt8Linear) or model.lm_head.bits == 8  # group panels, or not
    f = compare(ref, forced_run(int4, prompts, 24, ref))
    assert f.top1_agreement >= 0.75, f


@pytest.mark.slow
def test_int8_activations_of_int4_name_their_own_kv(tmp_path: Path) -> None:
    """int8 activations change the keys and values, so offloaded KV is kept apart from plain int4's (the
    offload namespace), where a 4-bit kernel quantizes them (the 4-bit panels on AVX512-BF16, the AVX2
    4-bit loops of a float32 model); elsewhere the setting changes nothing. The scheduler's connector
    looks blocks up under the namespace the worker writes them to."""
    common = {"max_model_len": 256, "kv_cache_memory_gb": 0.05, "quantization": "int4"}
    spaces = {}
    for acts in ("int8", "bf16"):
        llm = LLM(int4_activations=acts, kv_offload=f"disk={tmp_path / acts}:20MB", **common)
        try:
            worker = llm.engine.executor.worker
            assert llm.engine.kv.connector.namespace == worker.kv_connector.disk.namespace
            spaces[acts] = worker.kv_connector.disk.namespace
            if acts == "int8":
                smalls = [getattr(m, "small", None) for m in worker.model.modules()]
                panels = any(getattr(k, "int8_activations", False) for k in smalls)
        finally:
            llm.close()
    assert (spaces["int8"] != spaces["bf16"]) == panels, spaces


@pytest.mark.slow
@pytest.mark.parametrize("acts", ["int8", "bf16"])
def test_int4_head_computes_the_files_q8_0_weights(model_path: Path, acts: str) -> None:
    """int4's 8-bit output head, where the group panels run: the embedded Q4_1 file's tied embedding's
    own Q8_0 blocks packed bit for bit, times the rows as 16-bit codes per group of 32 at every row
    count, with either int4_activations. Its logits are then the file's weights times the bf16 rows
    (float64) within bf16's rounding of the output and the codes' rounding at 2^-15 of each group's
    largest value, at 1, 3 and 40 rows. Elsewhere the head is the per-channel 8-bit layer."""
    from tokenmill.models.ops import g8_pack

    llm = LLM(quantization="int4", int4_activations=acts, max_model_len=128, kv_cache_memory_gb=0.05)
    try:
        model = llm.engine.executor.worker.model
        if not model.ops.group_panels_available():
            assert isinstance(model.lm_head, QuantizedLinear) and model.lm_head.bits == 8
            pytest.skip("the group panels run only on AVX512-BF16 CPUs without AMX: the head is per channel")
        head = model.lm_head
        assert isinstance(head, GroupInt8Linear)
        file = GGUFFile(model_path).int8_groups("token_embd.weight")
        assert file is not None  # the embedded file's embedding is Q8_0
        assert torch.equal(head.kernel.panels, g8_pack(file.q, file.scale))
        n, k = file.q.shape
        w = (file.q.double().view(n, k // 32, 32) * file.scale.double()[..., None]).view(n, k)
        g = torch.Generator().manual_seed(0)
        for rows in (1, 3, 40):
            x = (torch.randn(rows, k, generator=g) * 3).to(torch.bfloat16)
            out = head(x)
            exact = x.double() @ w.T
            largest = x.double().abs().view(rows, k // 32, 32).amax(-1).repeat_interleave(32, -1)
            bound = 2**-8 * exact.abs() + (2**-15 * largest + 2**-20 * x.double().abs()) @ w.abs().T
            assert bool(((out.double() - exact).abs() <= bound).all()), rows
    finally:
        llm.close()


def test_int4_head_codes_come_from_the_file(model_path: Path, tmp_path: Path, monkeypatch) -> None:
    """registry.load_int8_head_codes: a GGUF file's head (here the tied embedding) as its own Q8_0
    blocks, cached beside the file's weights (the second call reads the cache, not the file); none for a
    Hugging Face directory."""
    from tokenmill.models import registry

    file = GGUFFile(model_path).int8_groups("token_embd.weight")
    for attempt in range(2):
        codes = registry.checkpoint_codes(model_path, tmp_path).int8_head()
        assert codes is not None and set(codes) == {"lm_head"}
        assert torch.equal(codes["lm_head"].q, file.q) and torch.equal(codes["lm_head"].scale, file.scale)
        if attempt == 0:
            assert any(tmp_path.rglob("head8-codes-*/*/codes-done"))
            monkeypatch.setattr(GGUFFile, "int8_groups", lambda *_: pytest.fail("read the file again"))
    hf = tmp_path / "hf"
    hf.mkdir()
    (hf / "config.json").write_text('{"architectures": ["LlamaForCausalLM"], "model_type": "llama"}')
    assert registry.checkpoint_codes(hf, tmp_path).int8_head() is None


def test_int8_scales_setting_is_checked() -> None:
    from tokenmill.config import EngineConfig

    assert EngineConfig().int8_scales == "auto"  # groups for a Q8_0 file's own codes, channels otherwise
    with pytest.raises(ValueError, match="int8_scales"):
        EngineConfig(quantization="int8", int8_scales="row")


@pytest.mark.slow
def test_int8_takes_a_q8_0_files_codes_where_the_group_panels_run(q8_0_model_path: Path, caplog) -> None:
    """int8_scales "auto" on a Q8_0 file: every linear computes in the group panels with the file's own
    codes and scales, bit for bit as packed from the file (the tied output head with the embedding's
    Q8_0 blocks); "channel" keeps the per-channel form; their KV is named apart.
    Without the BF16 instructions (AVX2), "auto" takes the group form on the AVX2 8-bit loops of a
    float32 model. Where no group kernels run (AMX), both are the per-channel form, and "group" says
    why."""
    from tokenmill.models.linear import GroupInt8Linear, Int8Linear, int8_matmuls_available
    from tokenmill.models.ops import g8_pack
    from tokenmill.models.registry import checkpoint_codes

    common = {"max_model_len": 256, "kv_cache_memory_gb": 0.05, "quantization": "int8"}
    labels = {}
    for scales in ("auto", "channel"):
        llm = LLM(model=str(q8_0_model_path), int8_scales=scales, **common)
        try:
            worker = llm.engine.executor.worker
            kinds = {type(m) for m in worker.model.modules() if isinstance(m, (GroupInt8Linear, Int8Linear))}
            labels[scales] = llm.engine.info["weights_label"]
            if scales == "auto" and worker.model.quant.groups:
                assert kinds == {GroupInt8Linear}
                codes = checkpoint_codes(q8_0_model_path, None).int8()
                assert codes is not None
                qkv = worker.model.layers[0].self_attn.qkv_proj
                expected = codes["layers.0.self_attn.qkv_proj"]
                assert torch.equal(qkv.kernel.panels, g8_pack(expected.q, expected.scale))
                head = codes["lm_head"]
                assert torch.equal(worker.model.lm_head.kernel.panels, g8_pack(head.q, head.scale))
                out = llm.generate(["The capital of France is"], SamplingParams(max_tokens=4, temperature=0))
                assert out[0].outputs[0].text.strip()  # it decodes
            elif int8_matmuls_available(torch.device("cpu")):  # else int8 keeps bf16 weights
                assert kinds == {Int8Linear}
        finally:
            llm.close()
    groups = labels["auto"].startswith("int8-groups")  # "-f32" on the AVX2 loops of a float32 model
    assert labels["channel"] != labels["auto"] or not groups, labels
    if not groups:  # no group panels here: "group" falls back and says so
        with caplog.at_level("WARNING"):
            LLM(int8_scales="group", **common).close()
        assert "int8_scales group needs" in caplog.text


@pytest.mark.parametrize(
    "setting", [{"kernels": "torch"}, {"dtype": "float32"}], ids=["torch-ops", "float32"]
)
def test_int8_group_form_falls_back_to_channels_without_its_panels(setting: dict, caplog) -> None:
    """The plain-PyTorch ops have no group panels, and the panels write bf16: int8_scales="group" then
    quantizes per channel, saying why (on every CPU)."""
    from tokenmill.models.linear import Int8Linear, int8_matmuls_available

    with caplog.at_level("WARNING"):
        llm = LLM(
            quantization="int8", int8_scales="group", max_model_len=128, kv_cache_memory_gb=0.05, **setting
        )
    try:
        model = llm.engine.executor.worker.model
        assert not model.quant.groups
        if int8_matmuls_available(torch.device("cpu")):  # else int8 keeps bf16 weights (and says so)
            assert any(isinstance(m, Int8Linear) for m in model.modules())
    finally:
        llm.close()
    assert "int8_scales group needs" in caplog.text
