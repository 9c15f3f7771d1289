"""Accelerators for sizing: peak dense FLOPs per precision, memory, bandwidth, links, power, price.

Figures are dense tensor-core peaks (the 2x "with sparsity" numbers are not used), from the
datasheet-derived table in ../shared/reference/bench_and_sizing.md section 3.1. Prices per GPU-hour are
indicative on-demand cloud prices, an assumption to override with --gpu-hour-price. "cpu-2c" is the
2-core Sapphire Rapids machine this project is developed on, so that the model can be calibrated and
checked against real `tokenmill bench` runs here: its peak is nominal (AMX bf16), its bandwidth the
~20 GB/s measured with a large read (docs/history/benchmarks.md), and it is meant to be calibrated.
"""

from __future__ import annotations

from dataclasses import dataclass, field

# Bytes per weight and per KV-cache element for each precision name.
PRECISIONS: dict[str, tuple[float, float]] = {
    "fp16": (2.0, 2.0),
    "bf16": (2.0, 2.0),
    "fp8": (1.0, 1.0),  # FP8 weights and FP8 KV cache
    "int8": (1.0, 2.0),  # INT8 weights (W8A8), 16-bit KV cache
    "int4": (0.5, 2.0),  # weight-only INT4, 16-bit activations and KV cache
}

# Bytes per KV-cache element when the cache's dtype is set on its own (`--kv-cache-dtype`, as vLLM's
# flag): "auto" keeps the precision's. 8-bit caches are counted at one byte an element; tokenmill's own
# rows add a float32 scale per (token, head), 4 / head_dim more (3% at head size 128).
KV_CACHE_DTYPES: dict[str, float | None] = {"auto": None, "fp16": 2.0, "bf16": 2.0, "fp8": 1.0, "int8": 1.0}


@dataclass(frozen=True)
class Gpu:
    name: str
    tflops_16: float  # dense BF16/FP16
    tflops_8: float | None  # dense FP8 (or INT8 where there is no FP8); None: runs FP8 at 16-bit speed
    memory_gb: float
    bandwidth_tbs: float
    link_gbs: float  # GPU-to-GPU bandwidth per direction (NVLink; PCIe where there is none)
    tdp_w: float
    gpus_per_server: int = 8
    gpu_hour_price: float = 0.0  # indicative, USD
    description: str = ""

    def peak_tflops(self, precision: str) -> float:
        """Matmul peak for the precision's compute type (weight-only INT4 computes in 16-bit)."""
        if precision in ("fp8", "int8") and self.tflops_8:
            return self.tflops_8
        return self.tflops_16


@dataclass(frozen=True)
class Factors:
    """Efficiency factors of the roofline model: what share of the peaks real software reaches."""

    mfu: float = 0.6  # share of peak FLOPs in prefill
    mbu_weights: float = 0.9  # share of peak bandwidth reading weights
    mbu_kv: float = 0.8  # share of peak bandwidth reading the KV cache
    overhead_per_layer_s: float = 100e-6  # fixed per-iteration cost per layer (kernel launches, scheduling)
    allreduce_latency_s: float = 40e-6  # per all-reduce, on top of its bytes / link bandwidth
    link_efficiency: float = 0.8  # share of the link bandwidth a ring all-reduce reaches (NCCL-like)
    client_s: float = 0.0  # fixed client-side share of TTFT (HTTP, tokenization)
    source: str = field(default="generic", compare=False)

    def to_dict(self) -> dict:
        return dict(self.__dict__)


CATALOG: dict[str, Gpu] = {
    g.name: g
    for g in [
        Gpu(
            "a100-80gb", 312, 624, 80, 2.039, 300, 400, 8, 1.80, "A100 SXM 80GB (no FP8: INT8 peak for 8-bit)"
        ),
        Gpu("h100-sxm", 989, 1979, 80, 3.35, 450, 700, 8, 2.50, "H100 SXM 80GB, DGX/HGX H100"),
        Gpu("h200", 989, 1979, 141, 4.8, 450, 700, 8, 3.50, "H200 SXM 141GB"),
        Gpu("l40s", 362, 733, 48, 0.864, 32, 350, 8, 1.00, "L40S 48GB, PCIe only"),
        Gpu("b200", 2250, 4500, 180, 8.0, 900, 1000, 8, 5.00, "B200 HGX (180 GB usable)"),
        Gpu(
            "gb200-nvl72",
            2500,
            5000,
            186,
            8.0,
            900,
            1200,
            72,
            6.00,
            "GB200 NVL72 rack: 72 GPUs in one NVLink domain",
        ),
        Gpu(
            "cpu-2c", 4.0, None, 24, 0.020, 0.0, 0.0, 1, 0.0, "this 2-core Sapphire Rapids VM (calibrate it)"
        ),
    ]
}

# Default factors by (gpu, precision): fits to TensorRT-LLM 0.9 static-batch measurements for the
# GPUs and precisions the reference notes give (section 6.5), with the fixed overhead per layer
# (~100 us per layer per iteration, NIM 1.0 on H100, section 6.4) because a flat overhead does not
# transfer between model sizes. Other pairs use the H100 figures of the same precision class.
_DEFAULTS: dict[tuple[str, str], Factors] = {
    ("h100-sxm", "fp16"): Factors(0.60, 1.00, 0.90, source="TRT-LLM 0.9 H100 FP16 fit"),
    ("h100-sxm", "fp8"): Factors(
        0.52, 0.86, 0.79, allreduce_latency_s=39e-6, source="TRT-LLM 0.9 H100 FP8 fit"
    ),
    ("a100-80gb", "fp16"): Factors(0.71, 1.00, 0.62, source="TRT-LLM 0.9 A100 FP16 fit"),
    ("h200", "fp8"): Factors(0.54, 0.73, 0.62, source="TRT-LLM 0.9 H200 FP8 fit"),
    ("l40s", "fp8"): Factors(0.43, 0.85, 0.77, source="TRT-LLM 0.9 L40S FP8 fit"),
}

# NIM 1.0 (GenAI-Perf closed-loop) fits for Llama-3-8B on H100, TP1, C <= 25 (section 6.4): the
# engine the source documents' throughput table was measured with.
NIM_H100: dict[str, Factors] = {
    "fp8": Factors(
        0.71, 1.00, 0.35, 3.2e-3 / 32, client_s=5.7e-3, source="NIM 1.0 H100 FP8 fit (Llama-3-8B)"
    ),
    "fp16": Factors(
        0.81, 1.00, 0.39, 3.2e-3 / 32, client_s=7.6e-3, source="NIM 1.0 H100 FP16 fit (Llama-3-8B)"
    ),
}


def precision_class(precision: str) -> str:
    return "fp8" if precision in ("fp8", "int8") else "fp16"


def default_factors(gpu: str, precision: str) -> Factors:
    cls = precision_class(precision)
    if (gpu, cls) in _DEFAULTS:
        return _DEFAULTS[(gpu, cls)]
    for (g, _), f in _DEFAULTS.items():
        if g == gpu:
            return Factors(**{**f.to_dict(), "source": f"{f.source} (used for {precision})"})
    base = _DEFAULTS[("h100-sxm", cls)]
    return Factors(**{**base.to_dict(), "source": f"{base.source} (no fit for {gpu}; H100 figures)"})


def resolve(name: str) -> Gpu:
    if name not in CATALOG:
        raise ValueError(f"GPU {name!r} is not in the catalog ({', '.join(CATALOG)})")
    return CATALOG[name]
