"""The quantization methods by name, and the one place a built model's linears take theirs.

A method is made for one model as it is built (the module with the checkpoint's weights, its ops chosen
for this CPU) and replaces each linear (the output head included) with the layer of its form: it picks
each layer's kernel from `model.ops` (models/ops.py: the kernels of this CPU's instruction-set level,
or plain PyTorch, which is also what CUDA runs), and takes the file's own codes where the form matches
them. What every method shares is here: smoothing before, the float32-arithmetic widening of what stays
bf16, and the packing of the plain linears that remain.
"""

from __future__ import annotations

import functools
import logging
from typing import Any, ClassVar

import torch
from torch import nn

from tokenmill.models.linear import LinearBase, WideFor, pack_linears
from tokenmill.models.ops import CpuFusedOps
from tokenmill.models.quant.config import QuantConfig
from tokenmill.models.smoothing import smooth_model, why_not_smoothable
from tokenmill.models.wide_linear import WideEmbedding, WideLinear, widen_linears

log = logging.getLogger(__name__)


class QuantMethod:
    """One form of a model's linears: made for the model as it is built, applied once."""

    name: ClassVar[str | None]
    # Whether a float32 model of bf16 weights (models/wide_linear.py) takes this method: its kernels take
    # float32 rows, or what it leaves in bf16 is widened.
    float32_rows: ClassVar[bool] = False

    def __init__(self, model: Any, dtype: torch.dtype, quant: QuantConfig) -> None:
        self.model, self.dtype, self.quant = model, dtype, quant
        # The strength the weights were smoothed with before quantizing (models/smoothing.py), or None.
        self.smoothed_alpha: float | None = None

    def smooths(self) -> bool:
        """Whether a given calibration smooths the weights before this method quantizes them."""
        return True

    def apply(self, wide_for: WideFor | None) -> None:
        """Replace the model's linears by this form's (`wide_for`: the widened bf16 layer, for a float32
        model, of a weight the method keeps in bf16)."""

    def label(self) -> str | None:
        """The weights' form as far as it changes the keys and values a model computes (the worker's
        weights label, which names its KV blocks apart): None for the checkpoint's own weights."""
        if self.smoothed_alpha is not None:
            return f"{self.name}-smoothed-{self.smoothed_alpha}"
        return self.name


METHODS: dict[str | None, type[QuantMethod]] = {}


def register(cls: type[QuantMethod]) -> type[QuantMethod]:
    METHODS[cls.name] = cls
    return cls


def method_names() -> list[str]:
    return sorted(n for n in METHODS if n is not None)


def method_class(name: str | None) -> type[QuantMethod]:
    if name not in METHODS:
        raise ValueError(f"unknown quantization {name!r}; available: {', '.join(method_names())}")
    return METHODS[name]


def quantize_model(model: nn.Module, dtype: torch.dtype, quant: QuantConfig) -> QuantMethod:
    """Give every linear of a built model (its weights loaded, `model.ops` set) the form `quant` names,
    then pack what stays plain. Returns the method as applied."""
    method = method_class(quant.method)(model, dtype, quant)
    if quant.calibration is not None and method.smooths():
        # Before any weight is quantized or packed: the factors are folded into plain weights.
        reason = why_not_smoothable(model)
        if reason is not None:
            log.warning("weights not smoothed: %s", reason)
        else:
            method.smoothed_alpha = smooth_model(model, quant.calibration, quant.smoothing_alpha)
    ops = model.ops
    # A float32 model of bf16 weights (models/wide_linear.py): its linears, and int4's copies for big
    # steps, as bf16 panels computed in float32.
    widen = quant.bf16_weights and isinstance(ops, CpuFusedOps)
    kernels = ops.k if isinstance(ops, CpuFusedOps) else None
    method.apply(functools.partial(WideLinear, kernels=kernels) if widen else None)
    if widen:
        widen_linears(model, kernels)  # the output head too: tied, it gets panels of its own
        if model.shard.first_stage:
            model.embed_tokens = WideEmbedding(model.embed_tokens)
    pack_linears(model, ops.small_matmul_for, ops.panels_take_every_row())
    return method


def linear_kernels(model: nn.Module) -> dict[str, int]:
    """How many of the model's linears run each kernel: the layer's own kernel object where it holds one
    (the panel kernels of models/ops.py), else the layer's class (oneDNN's packed matmul, PyTorch's)."""
    counts: dict[str, int] = {}

    def visit(m: nn.Module) -> None:
        if isinstance(m, LinearBase) or type(m) is nn.Linear:  # not its inner copies
            k = next((getattr(m, a) for a in ("kernel", "small") if getattr(m, a, None) is not None), m)
            counts[type(k).__name__] = counts.get(type(k).__name__, 0) + 1
            return
        for child in m.children():
            visit(child)

    visit(model)
    return counts


@register
class Unquantized(QuantMethod):
    """The checkpoint's weights in the model's dtype: oneDNN's packed copy and the panel kernels where
    they run (quantize_model's packing), plain matmuls elsewhere."""

    name = None
    float32_rows = True
