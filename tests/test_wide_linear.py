"""bfloat16 weights with float32 arithmetic (models/wide_linear.py), the path of CPUs without BF16
instructions: which builds take it, and the embedded model on it against Hugging Face transformers in
float32 on the same bf16-rounded weights (greedy tokens equal, logprobs within float32's reordering).
The kernel itself is checked against float64 at every level in test_kernels_isa.py, and the C++ decode
step's bits on it in test_decode_step.py."""

from __future__ import annotations

import copy

import pytest
import torch
from reference import hf_greedy

from tokenmill import LLM, SamplingParams
from tokenmill.kernels.isa import get_level
from tokenmill.models.quant.arithmetic import float32_arithmetic
from tokenmill.models.wide_linear import WideLinear

CPU = torch.device("cpu")
NEW_TOKENS = 24
LOGPROB_TOL = 2e-3  # as test_correctness_hf.py: float32 in another order is ~1e-5 off


def test_which_builds_compute_bf16_models_in_float32() -> None:
    bf16 = torch.bfloat16
    assert float32_arithmetic(bf16, CPU, "avx2", None)
    assert float32_arithmetic(bf16, CPU, "avx512", None)  # AVX-512 without BF16 (Skylake-SP, Ice Lake)
    assert not float32_arithmetic(bf16, CPU, "avx512_bf16", None)
    assert not float32_arithmetic(bf16, CPU, "torch", None), "the reference stays bf16"
    assert not float32_arithmetic(torch.float32, CPU, "avx2", None)
    assert float32_arithmetic(bf16, CPU, "avx2", "int4"), "int4's copy for big steps: widened bf16 panels"
    assert float32_arithmetic(bf16, CPU, "avx2", "int8"), "int8 in groups by the AVX2 8-bit loops"
    assert not float32_arithmetic(bf16, CPU, "avx2", "fp8"), "fp8 keeps its own arithmetic"
    assert not float32_arithmetic(bf16, torch.device("cuda"), "avx2", None)


@pytest.fixture(scope="module")
def llm_wide() -> LLM:
    if not get_level("avx2").supported():
        pytest.skip("this CPU has no AVX2: the kernels' avx2 build cannot run")
    return LLM(kernels="avx2", max_model_len=512)  # dtype "auto": the avx2 build has no BF16 loops


def test_the_engine_holds_bf16_panels_and_computes_in_float32(llm_wide: LLM) -> None:
    worker = llm_wide.engine.executor.worker  # type: ignore[attr-defined]
    model = worker.model
    assert worker.dtype == torch.float32 and worker.bf16_weights
    wide = [m for m in model.modules() if isinstance(m, WideLinear)]
    assert len(wide) == 4 * model.config.num_layers + 1, "every linear, the output head included"
    assert all(m.panels.dtype == torch.bfloat16 for m in wide)
    assert model.embed_tokens.weight.dtype == torch.bfloat16, "the table stays bf16 too"
    assert model.layer_loop is not None, "the runner runs decode steps in the C++ layer loop"


@pytest.mark.slow
def test_greedy_tokens_equal_transformers_float32_on_the_bf16_weights(llm_wide: LLM, hf_model) -> None:
    ref_model = copy.deepcopy(hf_model)
    with torch.no_grad():
        for p in ref_model.parameters():  # the weights bf16 holds (not the buffers: rotary's inv_freq)
            p.copy_(p.bfloat16().float())
    tok = llm_wide.tokenizer
    prompts = [
        tok.encode_chat([{"role": "user", "content": "What is the capital of France?"}]),
        tok.encode("def fibonacci(n):\n    "),
        tok.encode("In 1969, the first humans landed on the Moon. The mission was called"),
    ]
    params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True, logprobs=5)
    outs = llm_wide.generate(prompts, [params] * len(prompts), use_tqdm=False)  # batched: steps of 3 rows
    for i, (p, out) in enumerate(zip(prompts, outs, strict=True)):
        ref_tokens, ref_lps = hf_greedy(ref_model, p, NEW_TOKENS)
        assert out.outputs[0].token_ids == ref_tokens, f"prompt {i} diverges from transformers"
        for ours, theirs in zip(out.outputs[0].logprobs, ref_lps, strict=True):
            for tid, lp in ours.top:
                assert abs(lp - float(theirs[tid])) < LOGPROB_TOL


def test_int4_on_the_avx2_path_reads_4_bits_at_decode_and_8bit_groups_above() -> None:
    """`quantization="int4"` on the avx2 build: decode steps of up to 4 rows on the AVX2 4-bit loops
    (W4A8, checked against float64 in test_kernels_isa.py, and in the C++ step in test_decode_step.py),
    bigger steps on a copy of the 4-bit weights in int8 groups on the AVX2 8-bit loops (W8A8); with
    bf16 activations (W4A16) on widened bf16 panels, whose arithmetic keeps the activations."""
    if not get_level("avx2").supported():
        pytest.skip("this CPU has no AVX2: the kernels' avx2 build cannot run")
    from tokenmill.models.linear import GroupInt8Linear, QuantizedLinear
    from tokenmill.models.ops import G8WidePanels, Q4WidePanels

    llm = LLM(kernels="avx2", quantization="int4", max_model_len=256, enable_prefix_caching=False)
    try:
        worker = llm.engine.executor.worker  # type: ignore[attr-defined]
        assert worker.dtype == torch.float32 and worker._weights_label() == "int4-a8-f32"
        layers = [m for m in worker.model.modules() if isinstance(m, QuantizedLinear) and m.bits == 4]
        assert layers and all(isinstance(m.small, Q4WidePanels) for m in layers)
        assert all(isinstance(m.wide, GroupInt8Linear) for m in layers)
        assert all(isinstance(m.wide.kernel, G8WidePanels) for m in layers)
        step = worker.model.layer_loop  # the runner's C++ step
        assert step is not None and step.max_rows == 4, "decode steps of up to 4 rows run the C++ loop"
        out = llm.generate(["The capital of France is"], [SamplingParams(temperature=0.0, max_tokens=8)])
        assert len(out[0].outputs[0].token_ids) == 8
    finally:
        llm.close()
    llm = LLM(kernels="avx2", quantization="int4", int4_activations="bf16", max_model_len=256)
    try:
        model = llm.engine.executor.worker.model  # type: ignore[attr-defined]
        layers = [m for m in model.modules() if isinstance(m, QuantizedLinear) and m.bits == 4]
        assert layers and all(isinstance(m.wide, WideLinear) for m in layers)
    finally:
        llm.close()


def test_int8_on_the_avx2_path_takes_the_8bit_loops_at_every_step() -> None:
    """`quantization="int8"` on the avx2 build: a float32 model whose every linear, the output head
    included, holds int8 codes in groups of 32 and runs the AVX2 8-bit loops (W8A8, checked against
    float64 in test_kernels_isa.py) at every row count, decode steps in the C++ loop (its bits in
    test_decode_step.py); the group form is never smoothed, and its keys and values are named apart."""
    if not get_level("avx2").supported():
        pytest.skip("this CPU has no AVX2: the kernels' avx2 build cannot run")
    from tokenmill.models.decode_step import G8WIDE
    from tokenmill.models.linear import GroupInt8Linear
    from tokenmill.models.ops import G8WidePanels

    llm = LLM(kernels="avx2", quantization="int8", max_model_len=256, enable_prefix_caching=False)
    try:
        worker = llm.engine.executor.worker  # type: ignore[attr-defined]
        assert worker.dtype == torch.float32 and worker._weights_label() == "int8-groups-f32"
        layers = [m for m in worker.model.modules() if isinstance(m, GroupInt8Linear)]
        assert len(layers) == 4 * worker.model.config.num_layers + 1, "every linear, the output head included"
        assert all(isinstance(m.kernel, G8WidePanels) for m in layers)
        assert not any(isinstance(m, WideLinear) for m in worker.model.modules())
        step = worker.model.layer_loop  # the runner's C++ step
        assert step is not None and step.kinds == {G8WIDE} and step.max_rows is None
        out = llm.generate(["The capital of France is"], [SamplingParams(temperature=0.0, max_tokens=8)])
        assert len(out[0].outputs[0].token_ids) == 8
    finally:
        llm.close()
