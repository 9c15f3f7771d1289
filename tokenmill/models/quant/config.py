"""What a model is quantized with: the method's name and its options, and where the checkpoint's own
codes come from. Plain data, built once by the worker (worker/worker.py) from the engine config."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from tokenmill.models.smoothing import Calibration
from tokenmill.weights.group_codes import GroupCodes, Int8Groups


class FileCodes(Protocol):
    """The quantized codes a checkpoint file holds, each kind read on first ask (weights/loader.py's
    CheckpointCodes); None for a kind it does not hold."""

    def int4(self) -> dict[str, GroupCodes] | None: ...

    def int8(self) -> dict[str, Int8Groups] | None: ...

    def int8_head(self) -> dict[str, Int8Groups] | None: ...


@dataclass(frozen=True)
class QuantConfig:
    """`method`: a registered method's name (quant/method.py's METHODS: "int4", "int8", "fp8"), or None
    for the checkpoint's own weights. `int4_activations`: "int8" quantizes the activations of int4 steps
    where the 4-bit kernels take them (W4A8), "bf16" keeps them (W4A16). `int8_scales`: int8's "channel",
    "group" or "auto" form (config.py). `calibration`: what to smooth the activations on before int8's
    per-channel quantization (models/smoothing.py, strength `smoothing_alpha`); None leaves the weights as
    loaded. `bf16_weights`: a float32 model whose linears keep bf16 weights, widened to float32 by the
    kernels (models/wide_linear.py). `codes`: the file's own codes, which the methods take as they are."""

    method: str | None = None
    int4_activations: str = "int8"
    int8_scales: str = "auto"
    calibration: Calibration | None = None
    smoothing_alpha: float = 0.7
    bf16_weights: bool = False
    codes: FileCodes | None = None
