"""fp8: e4m3 weights with a scale per output channel (models/fp8_linear.py)."""

from __future__ import annotations

from tokenmill.models.fp8_linear import quantize_linears_fp8
from tokenmill.models.linear import WideFor
from tokenmill.models.quant.method import QuantMethod, register


@register
class Fp8(QuantMethod):
    name = "fp8"

    def apply(self, wide_for: WideFor | None) -> None:
        ops = self.model.ops
        quantize_linears_fp8(self.model, ops.e4m3_rows, ops.scale_rows_cols, small_for=ops.fp8_matmul_for)
