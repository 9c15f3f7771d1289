"""The limits the peer comparison sets each figure against (benchmarks/step_flops.py, peers/compare.py):
the FLOPs of a step counted against a hand count, and the roofline taking the longer of its two times."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import pytest

from tokenmill.sizing import arch

# The benchmark scripts are not a package: import them from their folders, then put the path back so
# that no other test resolves a top-level name to a benchmark script.
BENCH = Path(__file__).resolve().parents[1] / "benchmarks"
_saved = list(sys.path)
sys.path[:0] = [str(BENCH), str(BENCH / "peers")]
import compare  # noqa: E402
from step_flops import decode_step_gflop, matmul_rate_gflops  # noqa: E402

sys.path[:] = _saved

# SmolLM2-135M as its model card counts it: 134,515,008 parameters, the embedding tied to the head; of
# them the 61 RMSNorm weights of 576 (two a layer for 30 layers, and the final one) are in no matmul.
SMOLLM2_PARAMS = 134_515_008 - 61 * 576


def test_a_token_costs_two_flops_a_weight_plus_attention() -> None:
    a = arch.resolve("smollm2-135m")
    body, head = a.params_active_nonembedding, a.vocab * a.hidden
    assert body + head == SMOLLM2_PARAMS  # tied: the embedding's matrix is the head's
    width = a.heads * a.head_dim
    # One stream, no prompt, two output tokens: the mean context of its decode steps is one token.
    got = decode_step_gflop(body, head, width, a.layers, streams=1, isl=0, osl=2)
    assert got == pytest.approx((2 * SMOLLM2_PARAMS + 4 * width * a.layers * 1) / 1e9)
    # A prompt of 32 before 64 outputs: half a prompt token per output token through the layers (not the
    # head), its causal attention (32 x 32 / 2 pairs) shared over 64 tokens, and a mean context of 64.
    got = decode_step_gflop(body, head, width, a.layers, streams=32, isl=32, osl=64)
    per_stream = (
        2 * SMOLLM2_PARAMS + 0.5 * 2 * body + 4 * width * a.layers * 64 + 4 * width * a.layers * 32 * 16 / 64
    )
    assert got == pytest.approx(32 * per_stream / 1e9)


def test_unknown_arithmetic_is_refused() -> None:
    with pytest.raises(ValueError, match="bf16, float32 or int8"):
        matmul_rate_gflops("fp4")


def _one_level(tok_s: float, arithmetic: str) -> tuple[dict, dict]:
    results = {"e": {"levels": {"32": {"output_tok_s": tok_s}}}}
    bytes_ = {
        "e": {
            "weights": {32: 270e6},
            "kv_per_token": 23e3,
            "shape": compare.flop_shape(arch.resolve("smollm2-135m")),
            "arithmetic": {32: arithmetic},
        }
    }
    return results, bytes_


@pytest.mark.parametrize("arithmetic", ["bf16", "int8"])
def test_the_limit_is_the_longer_of_reading_and_computing(arithmetic: str) -> None:
    args = argparse.Namespace(isl=32, osl=64)
    gflop = decode_step_gflop(**compare.flop_shape(arch.resolve("smollm2-135m")), streams=32, isl=32, osl=64)
    bw_ms = (270e6 + 32 * 64 * 23e3) / 50e9 * 1e3
    # A machine that computes fast: the bytes bound the step.
    results, bytes_ = _one_level(1000.0, arithmetic)
    compare.add_limits(results, bytes_, 50.0, {"bf16": 1e6, "int8": 2e6}, args)
    lv = results["e"]["levels"]["32"]
    assert lv["bound"] == "bytes" and lv["limit_ms"] == pytest.approx(bw_ms)
    assert lv["of_limit"] == pytest.approx(bw_ms / 32.0)  # 1000 tok/s over 32 streams: 32 ms a step
    # A slow one: the step's arithmetic at the rate of what the engine multiplies in bounds it.
    results, bytes_ = _one_level(1000.0, arithmetic)
    rates = {"bf16": 500.0, "int8": 1000.0}
    compare.add_limits(results, bytes_, 50.0, rates, args)
    lv = results["e"]["levels"]["32"]
    flop_ms = gflop / rates[arithmetic] * 1e3
    assert flop_ms > bw_ms
    assert lv["bound"] == arithmetic and lv["limit_ms"] == pytest.approx(flop_ms)
    assert lv["of_bw_limit"] == pytest.approx(bw_ms / 32.0)
