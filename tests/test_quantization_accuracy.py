"""What each quantization costs in accuracy, against the bf16 model on the same text (perplexity on
Python's own documentation topics, tokenmill/quality/perplexity.py), decoded as the engine decodes
(batched steps). Bounds from benchmarks/perplexity.py's measurement with room for other CPUs' rounding:
int4 reproduces the Q4_1 file's weights and multiplies them exactly by bf16 activations (+0.04% here;
with int8 activations above 2 rows, its default, +0.45%), int8 quantizes activations per row (+0.8% here
with its default smoothing, +5.3% without: tokenmill/models/smoothing.py), fp8 rounds weights and
activations to e4m3 (+2.5%); the 8-bit KV caches measured +0.25% (int8) and +1.0% (fp8 e4m3, three
mantissa bits). Figures from AMD Zen 4; the bounds leave room for other CPUs' rounding."""

from __future__ import annotations

import pytest
import torch

from tokenmill import LLM
from tokenmill.kernels.isa import get_level
from tokenmill.models.linear import int8_matmuls_available
from tokenmill.models.quant.arithmetic import float32_arithmetic
from tokenmill.quality.perplexity import perplexity

pytestmark = pytest.mark.slow
# int8 runs where its int8 matmuls do (VNNI or AMX) and, without them, in groups on the AVX2 8-bit loops of
# a float32 model (models/quant/int8.py); elsewhere it keeps the bf16 weights and says so, and a bound on
# its error has nothing to measure.
INT8_RUNS = int8_matmuls_available(torch.device("cpu")) or float32_arithmetic(
    torch.bfloat16, torch.device("cpu"), "auto", "int8"
)
NO_INT8 = "int8 keeps the bf16 weights on this CPU (no VNNI or AMX, and no AVX2 kernels)"
COMMON = {"max_model_len": 256, "kv_cache_memory_gb": 0.1, "enable_prefix_caching": False}


@pytest.fixture(scope="module")
def bf16_ppl() -> float:
    return perplexity(LLM(**COMMON), n=16, steps=64).value


@pytest.mark.parametrize(("quantization", "bound"), [("int8", 0.03), ("int4", 0.01), ("fp8", 0.05)])
def test_quantized_perplexity_stays_near_bf16(bf16_ppl: float, quantization: str, bound: float) -> None:
    if quantization == "int8" and not INT8_RUNS:
        pytest.skip(NO_INT8)
    # int4 with bf16 activations (W4A16, exact products); its default W4A8 is bounded below.
    extra = {"int4_activations": "bf16"} if quantization == "int4" else {}
    p = perplexity(LLM(quantization=quantization, **extra, **COMMON), n=16, steps=64).value
    assert 1 - bound / 4 < p / bf16_ppl < 1 + bound, (quantization, p, bf16_ppl)


@pytest.fixture(scope="module")
def avx2_ppl() -> float:
    if not get_level("avx2").supported():
        pytest.skip("this CPU has no AVX2: the kernels' avx2 build cannot run")
    return perplexity(LLM(kernels="avx2", **COMMON), n=16, steps=64).value


@pytest.mark.parametrize(("quantization", "bound"), [("int8", 0.01), ("int4", 0.015)])
def test_the_avx2_paths_stay_near_their_bf16_weights(
    avx2_ppl: float, quantization: str, bound: float
) -> None:
    """The kernels of CPUs without BF16 instructions, on every CPU (kernels="avx2": a float32 model of
    bf16 weights, the reference here): int8 in groups of 32 on the AVX2 8-bit loops (W8A8; -0.06% on
    Intel Sapphire Rapids), int4 on the 4-bit loops and widened copies (W4A8; +0.13%)."""
    llm = LLM(kernels="avx2", quantization=quantization, **COMMON)
    assert llm.engine.info["weights_label"].endswith("-f32")  # the float32 model's own kernels
    p = perplexity(llm, n=16, steps=64).value
    assert 1 - bound / 4 < p / avx2_ppl < 1 + bound, (quantization, p, avx2_ppl)


def test_int4_with_int8_activations_stays_near_bf16(bf16_ppl: float) -> None:
    """int4_activations="int8", the default (W4A8 above 2 rows, where the 4-bit panels run; elsewhere a
    no-op): +0.45% here, +0.16% in benchmarks/perplexity.py's longer run. The bound fails the product
    that took the minimum's term from the exact bf16 sums rather than from the rounded activations'
    (+3.0% here, +1.5-1.75% in the longer run: kernels/csrc/panel_q4.cpp, quantize_groups)."""
    p = perplexity(LLM(quantization="int4", int4_activations="int8", **COMMON), n=16, steps=64).value
    assert 1 - 0.01 < p / bf16_ppl < 1 + 0.015, (p, bf16_ppl)


def test_int8_in_groups_of_32_stays_nearer_bf16(bf16_ppl: float, q8_0_model_path) -> None:
    """int8's group form (int8_scales, a scale per group of 32 on both sides, as llama.cpp multiplies a
    Q8_0 file): on the embedded model quantized so, and on its Q8_0 file's own codes (the form "auto"
    takes there). +0.32% for both in this short run, where the per-channel form measured +0.83% on the
    embedded model and +1.27% on the Q8_0 file, so the bound fails either; benchmarks/q8_0_accuracy.py's
    longer run: +0.29% on the Q8_0 file against +1.09% per channel. Only where the group panels run
    (AVX512-BF16 without AMX); elsewhere the setting falls back to the per-channel form, which the test
    above bounds."""
    probe = LLM(quantization="int8", int8_scales="group", **COMMON)
    if not probe.engine.executor.worker.model.quant.groups:
        pytest.skip("the group panels run only on AVX512-BF16 CPUs without AMX; int8 stays per channel here")
    grouped = perplexity(probe, n=16, steps=64).value
    del probe
    file_llm = LLM(model=str(q8_0_model_path), quantization="int8", **COMMON)
    assert file_llm.engine.executor.worker.model.quant.groups  # "auto" takes the file's codes
    from_file = perplexity(file_llm, n=16, steps=64).value
    for p in (grouped, from_file):
        assert 1 - 0.01 < p / bf16_ppl < 1 + 0.006, (grouped, from_file, bf16_ppl)


def test_int8_smoothing_is_what_brings_int8_near_bf16(bf16_ppl: float) -> None:
    """Unsmoothed, the same int8 model is past the bound above (+5.3% measured): the smoothing, not a
    lucky text, makes the difference."""
    if not int8_matmuls_available(torch.device("cpu")):
        pytest.skip("int8's per-channel form, the smoothed one, keeps bf16 weights without VNNI or AMX")
    p = perplexity(LLM(quantization="int8", int8_smoothing=0, **COMMON), n=16, steps=64).value
    assert p / bf16_ppl > 1.03, (p, bf16_ppl)


@pytest.mark.parametrize(("kv_cache_dtype", "bound"), [("int8", 0.01), ("fp8", 0.03)])
def test_8bit_kv_cache_perplexity_stays_near_bf16(bf16_ppl: float, kv_cache_dtype: str, bound: float) -> None:
    p = perplexity(LLM(kv_cache_dtype=kv_cache_dtype, **COMMON), n=16, steps=64).value
    assert 1 - bound / 4 < p / bf16_ppl < 1 + bound, (kv_cache_dtype, p, bf16_ppl)
