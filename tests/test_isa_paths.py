"""The code paths of other CPUs, run on this one: PyTorch's and oneDNN's kernels limited to a lower
instruction set (ONEDNN_MAX_CPU_ISA, ATEN_CPU_CAPABILITY) with tokenmill's kernels built for it.

Each combination runs tests/isa_paths.py in a subprocess (the limits are read once, at start-up) and
holds its errors against float64 references; a combination this CPU cannot run is skipped, saying so.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tokenmill.kernels.isa import cpu_summary, is_x86

SCRIPT = Path(__file__).parent / "isa_paths.py"

# (oneDNN's ceiling, ATen's capability, what the CPU must have, who runs it); tokenmill's own kernels
# at each level are checked op by op in test_kernels_isa.py.
COMBOS = [
    ("AVX2", "avx2", "avx2", "an AVX2-only laptop"),
    ("AVX512_CORE", "avx512", "avx512", "AVX-512 without BF16 (Skylake-SP, Ice Lake)"),
    ("AVX512_CORE_BF16", "avx512", "avx512_bf16", "AVX-512 BF16 without AMX (AMD Zen 4)"),
    ("AVX512_CORE_AMX", "avx512", "amx_tile", "AMX (Intel Sapphire Rapids)"),
]
# Norm-wise relative error bounds. bf16 outputs: the final rounding alone is ~1e-3 RMS and at most
# 2**-8; a bf16 accumulation over these 1536-long rows would be ~5e-2. The weight-only int4/int8 kernels
# round their activations to bf16 as well (measured ~2e-3), hence twice the bound.
BOUNDS = {
    "linear_rows1": 2**-8,
    "linear_rows64": 2**-8,
    "int4_rows2": 2**-7,
    "int8_rows2": 2**-7,
    "sdpa": 2**-8,
}


def run(onednn: str, aten: str, engine_level: str | None = None) -> dict:
    env = {**os.environ, "ONEDNN_MAX_CPU_ISA": onednn, "ATEN_CPU_CAPABILITY": aten}
    cmd = [sys.executable, str(SCRIPT)] + (["--engine", engine_level] if engine_level else [])
    r = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, r.stderr[-3000:]
    return json.loads(r.stdout.strip().splitlines()[-1])


def needs(feature: str, who: str) -> None:
    if not is_x86():
        pytest.skip("the instruction-set limits are x86 ones")
    if not getattr(torch.cpu, f"_is_{feature}_supported")():
        pytest.skip(f"this CPU cannot run the path of {who}: it has {cpu_summary()}")


@pytest.mark.slow
@pytest.mark.parametrize(("onednn", "aten", "feature", "who"), COMBOS, ids=[c[0] for c in COMBOS])
def test_linears_and_attention_at_each_isa(onednn: str, aten: str, feature: str, who: str) -> None:
    needs(feature, who)
    report = run(onednn, aten)
    assert report["aten_capability"].lower() == aten
    for key, bound in BOUNDS.items():
        assert report[key] < bound, (who, key, report)
    if onednn == "AVX2":
        assert report["packed"] == 0, "oneDNN packs bf16 weights only with AVX-512: plain linears here"


@pytest.mark.slow
def test_an_avx2_laptop_tracks_float32_as_closely_as_pytorch() -> None:
    # The whole engine as an AVX2-only CPU runs it: oneDNN and ATen limited to AVX2, tokenmill's
    # kernels built for AVX2. Teacher-forced against float32 (tokenmill/quality/fidelity.py), with the
    # same tolerance as test_fidelity.py.
    needs("avx2", "an AVX2-only laptop")
    report = run("AVX2", "avx2", engine_level="avx2")
    torch_path, kernels = report["engine"]["torch"], report["engine"]["avx2"]
    assert kernels["mean_kl"] <= 1.25 * torch_path["mean_kl"], report
    assert kernels["top1"] >= torch_path["top1"] - 0.02, report
