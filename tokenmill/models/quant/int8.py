"""int8: 8-bit weights, per output channel (smoothed first where a calibration is given: SmoothQuant) or
in groups of 32 (a Q8_0 file's own codes where it has them), times 8-bit activations. On CPUs without
BF16 instructions (a float32 model of bf16 weights: models/wide_linear.py) the group form by the AVX2 8-bit
loops (ops.G8WidePanels), the only int8 kernels there without VNNI."""

from __future__ import annotations

import functools
import logging
from typing import Any

import torch

from tokenmill.models.linear import (
    WideFor,
    int8_matmuls_available,
    quantize_linears_int8,
    quantize_linears_int8_groups,
)
from tokenmill.models.quant.codes import shard_codes
from tokenmill.models.quant.config import QuantConfig
from tokenmill.models.quant.method import QuantMethod, register

log = logging.getLogger(__name__)


@register
class Int8(QuantMethod):
    name = "int8"
    float32_rows = True  # the AVX2 8-bit loops take a float32 model's rows

    def __init__(self, model: Any, dtype: torch.dtype, quant: QuantConfig) -> None:
        super().__init__(model, dtype, quant)
        self.groups, self.file_codes = self._groups_form()

    def _groups_form(self) -> tuple[bool, dict | None]:
        """Whether int8 takes its group form (a scale per group of 32 on both sides) here, and the file's
        own codes for it: where the group panels run (they write bf16), when asked for, or with "auto"
        when the file has Q8_0 codes (read only then); elsewhere the per-channel form, saying why if
        asked."""
        scales, codes, ops = self.quant.int8_scales, self.quant.codes, self.model.ops
        if scales == "channel":
            return False, None
        if self.quant.bf16_weights:
            # A float32 model: the AVX2 8-bit loops, its only int8 kernels (without VNNI the per-channel
            # form keeps bf16 weights), so "auto" takes them too.
            if not ops.group_wide_available():
                if scales == "group":
                    log.warning("int8_scales group needs the AVX2 8-bit loops; quantizing per channel")
                return False, None
            return True, codes.int8() if codes is not None else None
        if not ops.group_panels_available() or self.dtype != torch.bfloat16:
            why = "the group panel kernels (AVX512-BF16 without AMX) and a bfloat16 model"
            if scales == "group":
                log.warning("int8_scales group needs %s; quantizing per channel", why)
            return False, None
        given = codes.int8() if codes is not None else None
        return scales == "group" or given is not None, given

    def smooths(self) -> bool:
        # Smoothing is for the per-channel form, and only where int8 matmuls run (else bf16 stays).
        return not self.groups and int8_matmuls_available(next(self.model.parameters()).device)

    def label(self) -> str | None:
        return "int8-groups" if self.groups else super().label()  # the group form is never smoothed

    def apply(self, wide_for: WideFor | None) -> None:
        # Every linear, the output head included: per-channel int8 weights keep each vocabulary row's own
        # scale (measured in benchmarks/perplexity.py).
        model, ops = self.model, self.model.ops
        if self.groups:
            given = shard_codes(model, self.file_codes) if self.file_codes else None
            wide = self.quant.bf16_weights  # float32 rows; a layer the loops do not take stays bf16, widened
            group_for = functools.partial(ops.group_int8_matmul_for, float32_rows=wide)
            quantize_linears_int8_groups(
                model, group_for, ops.quantize_rows_u8, ops.scale_rows_, ops.int8_matmul_for, given,
                per_channel=not wide,
            )  # fmt: skip
        else:
            quantize_linears_int8(model, ops.quantize_rows_u8, ops.scale_rows_, ops.int8_matmul_for)
