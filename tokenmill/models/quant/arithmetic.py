"""Which arithmetic a bf16 model takes on this CPU: `dtype="auto"`'s choice (worker/worker.py)."""

from __future__ import annotations

import logging

import torch

from tokenmill.kernels.isa import best_level, cpu_summary, level_names
from tokenmill.models.quant.method import method_class
from tokenmill.models.wide_linear import WIDENING_LEVELS

log = logging.getLogger(__name__)


def float32_arithmetic(
    dtype: torch.dtype, device: torch.device, kernels: str, quantization: str | None
) -> bool:
    """Whether a model of `dtype` computes in float32 with bf16 weights here: a bf16 model on a CPU whose
    kernel build (`kernels`: "auto", "cpu" or a level; EngineConfig.kernels) has no BF16 loops, and
    `quantization` a method whose kernels take float32 rows (QuantMethod.float32_rows: none, int4, int8;
    fp8 keeps its own arithmetic)."""
    if dtype != torch.bfloat16 or device.type != "cpu" or not method_class(quantization).float32_rows:
        return False
    if kernels in level_names():
        level = kernels
    elif kernels in ("auto", "cpu"):
        best = best_level()
        level = best.name if best is not None else None
    else:
        return False
    return level in WIDENING_LEVELS


def announce(kernels: str) -> None:
    """The one line a start says about it."""
    if kernels in level_names():  # a build chosen by name, whatever the CPU has
        log.info("bfloat16 weights with float32 arithmetic: the %s kernel build has no BF16 loops", kernels)
    else:
        log.info("bfloat16 weights with float32 arithmetic: %s has no BF16 instructions", cpu_summary())
