"""What each quantization costs in accuracy, against the bf16 model on the same text (perplexity on
Python's own documentation topics, tokenmill/quality/perplexity.py), decoded as the engine decodes
(batched steps). Bounds from benchmarks/perplexity.py's measurement with room for other CPUs' rounding:
int4 reproduces the Q4_1 file's weights (+0.06% there), int8 quantizes activations per row (+4.3%), fp8
rounds weights and activations to e4m3 (+2.5%); the
8-bit KV caches measured +0.25% (int8) and +1.0% (fp8 e4m3, three mantissa bits)."""

from __future__ import annotations

import pytest

from tokenmill import LLM
from tokenmill.quality.perplexity import perplexity

pytestmark = pytest.mark.slow
COMMON = {"max_model_len": 256, "kv_cache_memory_gb": 0.1, "enable_prefix_caching": False}


@pytest.fixture(scope="module")
def bf16_ppl() -> float:
    return perplexity(LLM(**COMMON), n=16, steps=64).value


@pytest.mark.parametrize(("quantization", "bound"), [("int8", 0.07), ("int4", 0.01), ("fp8", 0.05)])
def test_quantized_perplexity_stays_near_bf16(bf16_ppl: float, quantization: str, bound: float) -> None:
    p = perplexity(LLM(quantization=quantization, **COMMON), n=16, steps=64).value
    assert 1 - bound / 4 < p / bf16_ppl < 1 + bound, (quantization, p, bf16_ppl)


@pytest.mark.parametrize(("kv_cache_dtype", "bound"), [("int8", 0.01), ("fp8", 0.03)])
def test_8bit_kv_cache_perplexity_stays_near_bf16(bf16_ppl: float, kv_cache_dtype: str, bound: float) -> None:
    p = perplexity(LLM(kv_cache_dtype=kv_cache_dtype, **COMMON), n=16, steps=64).value
    assert 1 - bound / 4 < p / bf16_ppl < 1 + bound, (kv_cache_dtype, p, bf16_ppl)
