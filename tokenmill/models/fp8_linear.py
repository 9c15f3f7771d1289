"""fp8 (e4m3) linears: the accuracy of an FP8 deployment, on a CPU that has no fp8 arithmetic.

The scheme is the common "FP8 dynamic" one of GPU serving (vLLM's `quantization="fp8"` with per-token
activations, llm-compressor's FP8_DYNAMIC): weights rounded once to float8 e4m3 with one scale per
output channel, activations rounded to e4m3 as each step runs with one scale per row, products summed
in float32 and scaled back. On CUDA that is one `torch._scaled_mm`. On a CPU the arithmetic is
emulated: every e4m3 number is exact in bf16 (4 significant bits of 8), so the weight codes live as
bf16 in oneDNN's packed layout, each step's activation codes are cast to bf16, the bf16 matmul sums
their products in float32, and the row and column scales multiply its output. That output is rounded to
bf16 once before the scales and once after (fp8 hardware rounds once): about 2^-9 relative more.
Where the ops give an fp8 panel kernel (AVX512-BF16 without AMX: kernels/csrc/panel_f8.cpp), every step
(256 rows a sweep) reads the weight codes one byte each instead, widened to bf16 as they stream in, and
rounds once; no bf16 copy is kept there. Memory: 1 byte a weight with the kernel, 2 (the bf16 copy)
without it.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from tokenmill.models import linear as linear_module
from tokenmill.models.linear import (
    CodesFor,
    LinearBase,
    PackedLinear,
    onednn_packing_available,
    plain_linears,
    takes,
)

E4M3 = torch.float8_e4m3fn
E4M3_MAX = float(torch.finfo(E4M3).max)  # 448


def to_e4m3(x: torch.Tensor, dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """x as e4m3 codes and float32 scales along `dim` (x ~= codes * scale): each slice's largest
    magnitude maps to 448; an all-zero slice gets the smallest normal scale, not a division by zero."""
    tiny = torch.finfo(torch.float32).tiny
    scale = (x.abs().amax(dim=dim, keepdim=True).float() / E4M3_MAX).clamp(min=tiny)
    return (x.float() / scale).to(E4M3), scale


E4m3Rows = Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor]]
ScaleRowsCols = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.dtype], torch.Tensor]


class Fp8Linear(LinearBase):
    """A linear computing what an fp8 (e4m3) weight-and-activation matmul computes (module doc)."""

    prepared = True

    def __init__(
        self,
        linear: nn.Linear,
        e4m3_rows: E4m3Rows,
        scale_rows_cols: ScaleRowsCols,
        small_for: CodesFor | None = None,
    ) -> None:
        """`e4m3_rows`, `scale_rows_cols`: the model's ops (models/ops.py), C++ kernels on a CPU;
        `small_for` (ops.fp8_matmul_for): a kernel over one-byte codes for steps of up to its max_rows; one
        of every row count is the only copy of the codes (no bf16 copy for oneDNN; KEEP_ONEDNN_COPY)."""
        super().__init__()
        self.e4m3_rows, self.scale_rows_cols = e4m3_rows, scale_rows_cols
        w = linear.weight.detach()
        self.out_features, self.in_features = w.shape
        codes, scale = to_e4m3(w, dim=1)
        self.bias = None if linear.bias is None else linear.bias.detach()
        self.on_cuda = w.device.type == "cuda"  # not `cuda`: that is nn.Module's method
        if self.on_cuda:
            self.w_codes_t, self.w_scales = codes.t(), scale.view(1, -1)  # _scaled_mm wants [K, N]
            return
        self.w_scales = scale.view(1, -1)  # float32 [1, N]
        # The few-row kernel writes bf16: only for bf16 models (a float32 one would never call it).
        wants_small = small_for is not None and linear.weight.dtype == torch.bfloat16
        self.small = small_for(codes, scale.flatten()) if wants_small else None  # type: ignore[misc]
        # Rows the kernel takes (None: every count; 0: none).
        self.small_rows: int | None = self.small.max_rows if self.small is not None else 0
        self.wide: nn.Module | None = None
        if self.small_rows is not None or linear_module.KEEP_ONEDNN_COPY:
            # bf16 whatever the model dtype: the codes are exact in it, and it is what oneDNN packs.
            wide = nn.Linear(self.in_features, self.out_features, bias=False)
            wide.weight = nn.Parameter(codes.to(torch.bfloat16), requires_grad=False)
            self.wide = PackedLinear(wide) if onednn_packing_available(wide.weight) else wide

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.on_cuda:
            codes, scale = to_e4m3(x, dim=-1)
            w, ws = self.w_codes_t, self.w_scales
            y = torch._scaled_mm(codes, w, scale_a=scale, scale_b=ws, out_dtype=x.dtype)
        else:
            codes, scale = self.e4m3_rows(x)
            if self.wide is None or (takes(self.small_rows, x.shape[0]) and x.dtype == torch.bfloat16):
                y = self.small(codes, scale)  # type: ignore[misc]  # the CPU ops' codes: held in bf16
                if x.dtype != torch.bfloat16:  # the kernel writes bf16 (for a bf16 model: not here)
                    y = y.to(x.dtype)
            else:
                y = self.scale_rows_cols(self.wide(codes), scale, self.w_scales, x.dtype)
        return y if self.bias is None else y + self.bias


def quantize_linears_fp8(
    model: nn.Module,
    e4m3_rows: E4m3Rows,
    scale_rows_cols: ScaleRowsCols,
    skip: tuple[str, ...] = ("lm_head",),
    small_for: CodesFor | None = None,
) -> int:
    """Replace every plain linear but those named in `skip` by an Fp8Linear; return the count. The output
    head stays in the model dtype, as FP8 checkpoints keep it (every logit depends on it). `small_for`
    (ops.fp8_matmul_for): the panel kernel where it runs, for every row count and the only copy of the
    codes."""
    sites = plain_linears(model, lambda full, _: full not in skip)
    for parent, name, _, child in sites:
        setattr(parent, name, Fp8Linear(child, e4m3_rows, scale_rows_cols, small_for))
    return len(sites)
