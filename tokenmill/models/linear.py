"""Linear layers prepared for the device they run on.

On a CPU with oneDNN, bfloat16 weights are reordered once into oneDNN's blocked layout: a matmul then
skips the per-call weight reorder, which measured 1.5x faster here at batch 1 and at batch 256
(benchmarks/linear_kernels.py). Where tokenmill's panel kernels take every step (AVX512-BF16 without
AMX: models/ops.py) their panels are the only copy instead. Elsewhere (CUDA, float32) the plain PyTorch
linear is used.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Protocol

import torch
from torch import nn

from tokenmill.kernels.isa import cpu_has
from tokenmill.weights.group_codes import GROUP, GroupCodes, Int8Groups, quantize_groups, quantize_int8_groups

log = logging.getLogger(__name__)
_packing_works: bool | None = None


class LinearBase(nn.Module):
    """What every linear layer of the models is, whatever holds or computes its weight: `in_features`
    in, `out_features` out (on this rank). The tensor-parallel layers (models/parallel_linear.py), and
    the packed and quantized forms they are turned into for the device, derive from it; so will LoRA
    linears. Code that walks a model for its linears looks for this one type."""

    in_features: int
    out_features: int
    # True for the forms a linear is turned into for its device (packed, quantized): not to be turned
    # again by another pass over the model.
    prepared: bool = False


def _probe_packing() -> bool:
    # oneDNN's bf16 weight packing needs AVX-512 (BW/VL/DQ) or AVX-NE-CONVERT and raises on an
    # AVX2-only CPU; trying it once on a tiny weight is the one check that cannot disagree with it.
    if not (torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")):
        return False
    try:
        torch.ops.mkldnn._reorder_linear_weight(torch.zeros(16, 16, dtype=torch.bfloat16), 1)
    except RuntimeError:
        return False
    return True


def onednn_packing_available(weight: torch.Tensor) -> bool:
    global _packing_works
    if weight.device.type != "cpu" or weight.dtype != torch.bfloat16:
        return False
    if _packing_works is None:
        _packing_works = _probe_packing()
    return _packing_works


def row_bucket(m: int) -> int:
    """The row count a matmul of `m` rows runs at: exact up to 16, then rounded up to a multiple of 8
    (to 512), 32 (to 1024), 64 beyond: about 110 shapes up to a 2048-token budget. oneDNN and the
    allocator keep state per distinct shape, and a server's steps come in every size up to the token
    budget: unbucketed, 600 distinct row counts of one layer grew the process by 1.1 GB; bucketed, all
    2048 by 0.2 GB. The padding is at most 7 rows up to 512 (under 3% where a step computes rather
    than reads weights) and under 7% above."""
    if m <= 16:
        return m
    step = 8 if m <= 512 else 32 if m <= 1024 else 64
    return -(-m // step) * step


# On CPUs whose panel kernels take every row count (models/ops.py: AVX512-BF16 without AMX) a linear
# keeps its panels as its only copy of the weights: oneDNN's would double their memory for steps the
# panels run as fast or faster (bf16 1.02-1.09x oneDNN's matmul at 256-2048 rows, int8 1.05-1.07x at
# 512-2048; docs/history/benchmarks.md). Benchmarks that compare the two in one model set this first.
KEEP_ONEDNN_COPY = False


def takes(max_rows: int | None, rows: int) -> bool:
    """Whether a kernel of `max_rows` rows (None: every row count) takes a step of `rows`."""
    return max_rows is None or rows <= max_rows


class PackedLinear(LinearBase):
    """A bf16 linear whose weight lives in oneDNN's blocked layout (CPU inference only), or only in the
    panels of a kernel that takes every row count."""

    prepared = True

    # The batch size oneDNN tunes the layout for; measured best across 1..256 rows (see module doc).
    PACK_HINT = 64

    def __init__(self, linear: nn.Linear, small: SmallMatmul | None = None) -> None:
        """`small`: a kernel for steps of at most `small.max_rows` rows (None: any), given its own copy of
        the weight (ops.small_matmul_for): such steps are bound by reading the weights, which oneDNN's
        matmul did at ~17 GB/s of the 25 this machine streams (kernels/csrc/panel_matmul.cpp). A kernel
        of every row count is the only copy (KEEP_ONEDNN_COPY)."""
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        sole = small is not None and small.max_rows is None and not KEEP_ONEDNN_COPY
        self.packed = (
            None if sole else torch.ops.mkldnn._reorder_linear_weight(linear.weight.detach(), self.PACK_HINT)
        )
        self.bias = None if linear.bias is None else linear.bias.detach()
        self.small = small

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        m = x.shape[0]
        if self.packed is None:  # the panels alone
            if x.dim() == 2 and x.dtype == torch.bfloat16 and x.stride(1) == 1:  # a step's rows, as ever
                y = self.small(x)  # type: ignore[misc]
            else:  # the kernel reads bf16 rows with contiguous elements
                rows = x.reshape(-1, self.in_features).to(torch.bfloat16).contiguous()
                y = self.small(rows).view(*x.shape[:-1], self.out_features).to(x.dtype)  # type: ignore[misc]
            return y if self.bias is None else y.add_(self.bias)
        if self.small is not None and takes(self.small.max_rows, m) and x.dim() == 2:
            y = self.small(x)
            return y if self.bias is None else y.add_(self.bias)
        padded = row_bucket(m) if x.dim() == 2 else m
        if padded == m:
            return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")
        x = torch.nn.functional.pad(x, (0, 0, 0, padded - m))
        return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")[:m]


class SmallMatmul(Protocol):
    """x @ W^T for a few rows (max_rows; None: any number), with W in the kernel's own layout (a callable
    the ops provide)."""

    max_rows: int | None

    def __call__(self, x: torch.Tensor) -> torch.Tensor: ...


# A few-row kernel that does not take every row count keeps a second copy of each weight beside oneDNN's;
# models whose packed linears take more than this keep only oneDNN's (the copy would cost more memory than
# a small model's speed is worth).
SMALL_COPY_LIMIT_BYTES = 1 << 30
SmallFor = Callable[[torch.Tensor], SmallMatmul | None]
# A quantized linear's copy for big steps in another form than a linear of the model's dtype.
WideFor = Callable[[nn.Linear], nn.Module]


class QuantMatmul(Protocol):
    """x @ W^T for quantized W (ops.quantized_matmul_for): up to `max_rows` rows, or any (None)."""

    max_rows: int | None

    def __call__(self, x: torch.Tensor) -> torch.Tensor: ...


# ops.quantized_matmul_for: (bits, codes, scales, minima or None) -> a kernel, or None.
QuantFor = Callable[[int, torch.Tensor, torch.Tensor, torch.Tensor | None], QuantMatmul | None]


class CodesMatmul(Protocol):
    """A matmul of quantized activations for up to `max_rows` rows (None: any): (the rows' codes [M, K],
    their float32 scales [M, 1]) -> [M, N] bf16, the weights' codes and scales held by the kernel. W8A8:
    uint8 codes q + 128 (ops.int8_matmul_for); fp8: e4m3 codes held in bf16 (ops.fp8_matmul_for)."""

    max_rows: int | None

    def __call__(self, x_codes: torch.Tensor, x_scales: torch.Tensor) -> torch.Tensor: ...


# ops.int8_matmul_for / ops.fp8_matmul_for: (weight codes [N, K], float32 column scales [N]) -> a kernel.
CodesFor = Callable[[torch.Tensor, torch.Tensor], CodesMatmul | None]


LinearSite = tuple[nn.Module, str, str, nn.Linear]  # (parent, attribute name, full name, the linear)


def plain_linears(model: nn.Module, keep: Callable[[str, nn.Linear], bool] | None = None) -> list[LinearSite]:
    """Every linear still computed by a plain matmul of its weight (and that `keep(full_name, linear)`
    accepts), listed before any is replaced."""
    sites: list[LinearSite] = []
    for parent_name, parent in list(model.named_modules()):
        for name, child in list(parent.named_children()):
            full = f"{parent_name}.{name}" if parent_name else name
            if _plain_linear(child) and (keep is None or keep(full, child)):
                sites.append((parent, name, full, child))
    return sites


def small_copy_allowed(sites: list[LinearSite], bytes_per_weight: int | None = None) -> bool:
    """Whether a few-row kernel's second copy of these linears' weights (`bytes_per_weight` each, default
    their own dtype's) fits SMALL_COPY_LIMIT_BYTES: above it the copy would cost more memory than a small
    model's speed is worth."""
    total = sum(c.weight.numel() * (bytes_per_weight or c.weight.element_size()) for *_, c in sites)
    if total > SMALL_COPY_LIMIT_BYTES:
        log.info("linears take %.1f GB: no few-row copy of the weights", total / 1e9)
        return False
    return True


def pack_linears(model: nn.Module, small_for: SmallFor | None = None, sole: bool = False) -> int:
    """Replace every nn.Linear that can be packed; return how many were. `small_for(weight)` gives a
    few-row kernel for a weight (ops.small_matmul_for): the only copy of the weights where it takes
    every row count (`sole`, ops.panels_take_every_row), else a second copy, used when the model's
    linears fit SMALL_COPY_LIMIT_BYTES."""
    sites = plain_linears(model, lambda _, child: onednn_packing_available(child.weight))
    if small_for is not None and not (sole and not KEEP_ONEDNN_COPY) and not small_copy_allowed(sites):
        small_for = None
    for parent, name, _, child in sites:
        small = small_for(child.weight.detach()) if small_for is not None else None
        setattr(parent, name, PackedLinear(child, small))
    return len(sites)


class QuantizedLinear(LinearBase):
    """Weight-only quantized linear for the small batches of decode steps, with a bf16 twin for big ones.

    A decode step at batch 1 streams every weight through the CPU once, so bytes are time: 4 bits
    (groups of 32, asymmetric, the format of a Q4_0/Q4_1 GGUF tensor) or 8 bits (one scale per output
    row) instead of 16. PyTorch's quantized kernels stop paying off at a few rows (they dequantize per
    row), so larger batches use a copy of the same dequantized weights in the model dtype. The two
    paths round differently, so logits can differ in their last bits between small and large batches.
    A kernel for every row count (`quant_for`'s with max_rows None: the 4-bit panels) replaces the
    copy in a bf16 model.
    """

    prepared = True

    GROUP = GROUP

    def __init__(
        self,
        linear: nn.Linear,
        bits: int,
        max_rows: int,
        quant_for: QuantFor | None = None,
        small_for: SmallFor | None = None,
        codes: GroupCodes | None = None,
        wide_for: WideFor | None = None,
    ) -> None:
        """`quant_for(bits, q, scale, lo)`: a faster kernel for the codes (ops.quantized_matmul_for);
        `small_for(weight)`: the bf16 copy's few-row kernel (ops.small_matmul_for), as a packed bf16
        linear has, for the steps above max_rows. `codes`: 4-bit codes to take as they are (a GGUF
        file's own, weights/group_codes.py) instead of quantizing the weight. `wide_for(linear)`: the
        copy for those steps in another form (a float32 model's: bf16 panels computed in float32,
        models/wide_linear.py) instead of a linear of the model's dtype."""
        super().__init__()
        w = linear.weight.detach()
        n, k = w.shape
        dtype = linear.weight.dtype
        # A float32 model whose big steps take another form (wide_for: CPUs without BF16 instructions)
        # gives PyTorch's int4 and int8 kernels bf16 rows: with float32 ones they ran SmolLM2-135M's
        # decode at 3.8 tok/s against 35 (Intel Sapphire Rapids held to AVX2, benchmarks/wide_bf16.py).
        self.kernel_dtype = torch.bfloat16 if wide_for is not None and dtype == torch.float32 else dtype
        self.bits = bits
        self.max_rows: int | None = max_rows
        self.in_features, self.out_features = k, n
        self.from_codes = codes is not None and bits == 4
        if bits == 4:
            if codes is not None and (codes.shape != (n, k) or codes.scale.shape != (n, k // GROUP)):
                raise ValueError(f"4-bit codes {codes.shape} do not fit a weight {(n, k)}")
            g = codes if codes is not None else quantize_groups(w)
            dequant = g.dequantize
            q, scale, lo = g.q, g.scale, g.lo
            self.small = quant_for(4, q, scale, lo) if quant_for else None
            if self.small is None:
                self.qweight = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q.to(torch.int32), 1)
                zero = lo + 8 * scale  # the kernel computes (q - 8) * scale + zero
                self.scales = torch.stack([scale.t(), zero.t()], -1).contiguous().to(self.kernel_dtype)
        elif bits == 8:
            w = w.float()
            scale = (w.abs().amax(dim=1) / 127).clamp(min=1e-10)
            q = torch.round(w / scale[:, None]).clamp(-127, 127)
            dequant = lambda: q * scale[:, None]  # noqa: E731 - only if the copy below is made
            self.small = quant_for(8, q.to(torch.int8), scale.to(dtype).float(), None) if quant_for else None
            if self.small is None:
                self.qweight = q.to(torch.int8).contiguous()
                self.scales = scale.to(self.kernel_dtype)
        else:
            raise ValueError(f"bits must be 4 or 8, got {bits}")
        self.bias = None if linear.bias is None else linear.bias.detach()
        # A kernel that takes the rows in any dtype (the AVX2 4-bit loops' float32 rows): no casts.
        self._small_any_dtype = bool(getattr(self.small, "any_dtype", False))
        if self.small is not None and self.small.max_rows is None and dtype == torch.bfloat16:
            self.max_rows, self.wide = None, None  # the kernel takes every step: no bf16 copy
            return
        wide = nn.Linear(k, n, bias=linear.bias is not None)
        wide.weight = nn.Parameter(dequant().to(dtype), requires_grad=False)
        if linear.bias is not None:
            wide.bias = nn.Parameter(linear.bias.detach(), requires_grad=False)
        if wide_for is not None:
            self.wide: nn.Module | None = wide_for(wide)
        elif onednn_packing_available(wide.weight):
            wide_small = small_for(wide.weight.detach()) if small_for is not None else None
            self.wide = PackedLinear(wide, wide_small)
        else:
            self.wide = wide
        self._wide = self.wide.forward  # type: ignore[union-attr]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.max_rows is not None and x.shape[0] > self.max_rows:
            return self._wide(x)
        if self.small is not None:
            # The kernels take bf16. The two no-op casts of a bf16 step were 1.5% of a 1.7B int4 model's
            # step at one stream (their argument parsing, in py-spy's profile), so they are skipped.
            if x.dtype == torch.bfloat16 or self._small_any_dtype:
                y = self.small(x)
            else:
                y = self.small(x.to(torch.bfloat16)).to(x.dtype)
        else:
            xk = x if x.dtype == self.kernel_dtype else x.to(self.kernel_dtype)
            if self.bits == 4:
                y = torch.ops.aten._weight_int4pack_mm_for_cpu(xk, self.qweight, self.GROUP, self.scales)
            else:
                y = torch.ops.aten._weight_int8pack_mm(xk, self.qweight, self.scales)
            y = y if y.dtype == x.dtype else y.to(x.dtype)
        return y if self.bias is None else y + self.bias


Quantize = Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor]]
ScaleRows = Callable[[torch.Tensor, torch.Tensor], None]


class Int8Linear(LinearBase):
    """int8 weights (one scale per output channel) times int8 activations (one scale per row,
    quantized as each step runs): W8A8 with dynamic activation scales, at every batch size.

    The int32 sums are exact; the output is sum * row scale * column scale. On a CPU the matmul is
    oneDNN's (AMX int8 tiles on Sapphire Rapids, AVX512-VNNI elsewhere; on AMD Zen 4 the panels below
    instead): half the weight bytes of bf16, which is the time of a decode step's matmuls, and twice the
    bf16 rate where they compute. Elsewhere (CUDA) `torch._int_mm`, or a float matmul of the same
    integers. `small` (ops.int8_matmul_for): a kernel for steps of up to its max_rows rows, where it beats
    oneDNN's; one of every row count holds the only copy of the codes (KEEP_ONEDNN_COPY)."""

    prepared = True

    def __init__(
        self, linear: nn.Linear, quantize: Quantize, scale_rows: ScaleRows, small_for: CodesFor | None = None
    ) -> None:
        super().__init__()
        w = linear.weight.detach().float()
        n, k = w.shape
        self.in_features, self.out_features = k, n
        # oneDNN only where it sums u8 x s8 products in 32 bits (VNNI, AMX): its AVX2 kernels were
        # measured off the exact sums by up to 0.4% of a row's largest output.
        self.onednn = w.device.type == "cpu" and _onednn_int8_available() and _onednn_vnni()
        scale = (w.abs().amax(dim=1) / 127).clamp(min=torch.finfo(torch.float32).tiny)
        self.qweight = torch.round(w / scale[:, None]).clamp(-127, 127).to(torch.int8)
        self.w_scales = scale  # float32 [N]
        self.bias = None if linear.bias is None else linear.bias.detach()
        self.quantize, self.scale_rows = quantize, scale_rows
        # The matmul's output dtype: the model's, or float32 where oneDNN would write bf16 through its
        # reference code (rounded after the row scales instead).
        dtype = linear.weight.dtype
        self.out_dtype = torch.float32 if dtype == torch.bfloat16 and not _onednn_bf16_output() else dtype
        # The few-row kernel writes bfloat16 (the scales applied in float32, rounded once).
        wants_small = small_for is not None and dtype == torch.bfloat16
        self.small = small_for(self.qweight, scale) if wants_small else None  # type: ignore[misc]
        # Rows the kernel takes (None: every count; 0: none, as benchmarks switch it off).
        self.small_rows: int | None = self.small.max_rows if self.small is not None else 0
        self.sole = self.small is not None and self.small_rows is None and not KEEP_ONEDNN_COPY
        if self.sole:
            self.onednn = False
            del self.qweight  # the kernel's panels hold the codes: one copy of the weights
        elif self.onednn:
            self.packed = torch.ops.onednn.qlinear_prepack(self.qweight, [PackedLinear.PACK_HINT, k])
            self.w_zero_points = torch.zeros(n, dtype=torch.long)
            del self.qweight  # the packed copy is the one used; keep one copy of the weights

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        m = x.shape[0]
        xq, xs = self.quantize(x)  # uint8 q + 128, float32 row scales
        if self.sole or (takes(self.small_rows, m) and x.dtype == torch.bfloat16):
            y = self.small(xq, xs)  # type: ignore[misc]
            if x.dtype != torch.bfloat16:  # the kernel writes bf16 (for a bf16 model: not on this path)
                y = y.to(x.dtype)
        elif self.onednn:
            # Rows bucketed as PackedLinear's are (oneDNN keeps state per shape); padding rows are 0.
            padded = row_bucket(m)
            if padded != m:
                xq = torch.nn.functional.pad(xq, (0, 0, 0, padded - m), value=128)
            w, ws, wz = self.packed, self.w_scales, self.w_zero_points
            # The activation scale passed is 1: the rows' own scales multiply the output after.
            y = _qlinear(xq, 1.0, 128, w, ws, wz, None, 1.0, 0, self.out_dtype, "none", [], "")
            y = y[:m] if padded != m else y
            if self.out_dtype == x.dtype:
                self.scale_rows(y, xs)
            else:
                y = (y * xs).to(x.dtype)
        elif x.device.type == "cuda" and m > 16:
            signed = (xq.to(torch.int16) - 128).to(torch.int8)
            y = (torch._int_mm(signed, self.qweight.t()) * xs * self.w_scales).to(x.dtype)
        else:
            y = (((xq.float() - 128) @ self.qweight.float().t()) * xs * self.w_scales).to(x.dtype)
        return y if self.bias is None else y + self.bias


# ops.group_int8_matmul_for: (codes [N, K] int8, scales [N, K/32] float32) -> a kernel for every row
# count, or None.
GroupFor = Callable[[torch.Tensor, torch.Tensor], QuantMatmul | None]


class GroupInt8Linear(LinearBase):
    """int8 weights with a scale per output channel and group of 32 input channels times int8
    activations with a scale per row and group of 32, quantized as each step runs: W8A8 in Q8_0's
    blocks, as llama.cpp multiplies a Q8_0 GGUF file. A group's scale follows its own largest value on
    both sides, so an outlier costs the precision of its group, not of its whole row or column: a Q8_0
    file's own codes computed so cost +0.29% perplexity against bf16, where Int8Linear's per-channel
    form (after smoothing) cost +1.09% on the same file (benchmarks/q8_0_accuracy.py; AMD Zen 4).
    Computed by the group panels (ops.group_int8_matmul_for) at every row count; built only where they
    run."""

    prepared = True

    def __init__(self, linear: nn.Linear, kernel: QuantMatmul) -> None:
        super().__init__()
        self.out_features, self.in_features = linear.weight.shape
        self.kernel = kernel
        self.bias = None if linear.bias is None else linear.bias.detach()

    @staticmethod
    def of(linear: nn.Linear, group_for: GroupFor, codes: Int8Groups | None = None) -> GroupInt8Linear | None:
        """The layer from `codes` (a Q8_0 file's own) or from its weight quantized into groups; None where
        the group panels do not take it (the caller quantizes it otherwise)."""
        n, k = linear.weight.shape
        # bf16 weights, or a float32 model's (of bf16 values: models/wide_linear.py) for the AVX2 loops.
        if k % GROUP or linear.weight.dtype not in (torch.bfloat16, torch.float32):
            return None
        if codes is not None and codes.shape != (n, k):
            raise ValueError(f"int8 codes {codes.shape} do not fit a weight {(n, k)}")
        g = codes if codes is not None else quantize_int8_groups(linear.weight.detach())
        kernel = group_for(g.q, g.scale)
        return GroupInt8Linear(linear, kernel) if kernel is not None else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.kernel(x)
        return y if self.bias is None else y + self.bias


_int8_works: bool | None = None
# The overload itself: calling the packet resolves it among four on every call. None in builds
# without oneDNN's quantized ops.
_qlinear = (
    torch.ops.onednn.qlinear_pointwise.default if hasattr(torch.ops.onednn, "qlinear_pointwise") else None
)


def _onednn_int8_available() -> bool:
    # Probed once on a tiny weight, as bf16 packing is: the op exists in CPU builds with oneDNN.
    global _int8_works
    if _int8_works is None:
        if _qlinear is None:
            _int8_works = False
            return False
        try:
            w = torch.ones(16, 16, dtype=torch.int8)
            p = torch.ops.onednn.qlinear_prepack(w, [1, 16])
            x = torch.full((1, 16), 129, dtype=torch.uint8)  # 1, at zero point 128
            scales, zps = torch.ones(16), torch.zeros(16, dtype=torch.long)
            y = _qlinear(x, 1.0, 128, p, scales, zps, None, 1.0, 0, torch.float32, "none", [], "")
            _int8_works = bool(torch.equal(y, torch.full((1, 16), 16.0)))
        except (RuntimeError, AttributeError):
            _int8_works = False
    return _int8_works


_bf16_out: bool | None = None


def _onednn_limit() -> str:
    """The instruction-set limit set on oneDNN (ONEDNN_MAX_CPU_ISA, or its older name DNNL_MAX_CPU_ISA)."""
    import os

    return (os.environ.get("ONEDNN_MAX_CPU_ISA") or os.environ.get("DNNL_MAX_CPU_ISA") or "ALL").upper()


def amx_brgemm_available() -> bool:
    """Whether the panel matmul of 3-96 rows runs on oneDNN's brgemm micro-kernel here: CPUs with AMX,
    with oneDNN allowed to use it. Without AMX the panel matmul's own dot loops are faster (ops.py)."""
    limit = _onednn_limit()
    return cpu_has("amx_tile") and torch.backends.mkldnn.is_available() and (limit == "ALL" or "AMX" in limit)


def bf16_brgemm_available() -> bool:
    """Whether the whole-prompt attention kernel (oneDNN's brgemm micro-kernel on bf16 pairs) runs here:
    CPUs with AMX tiles or with AVX512-BF16 (vdpbf16ps), with oneDNN allowed to use them. Below that
    PyTorch refuses the packed layout, so a limit set on oneDNN counts as the CPU.

    On AMD Zen 4 (AVX512-BF16, no AMX) the kernel is 3.3x PyTorch's SDPA on the offline mix
    (`benchmarks/prefill_attention.py`): SDPA's bf16 products go through MKL, which on AMD CPUs runs
    its generic code path (`perf`: mkl_blas_def_xgemm_bf16bf16f32 into mkl_blas_def_sgemm_kernel_0_zen,
    ~60 GFLOP/s). An earlier figure of 0.44-0.75x came from the Intel AMX machine with only oneDNN held
    to AVX512_CORE_BF16, where MKL (not bound by that limit) presumably kept SDPA on its fast path."""
    if not torch.backends.mkldnn.is_available():
        return False
    limit = _onednn_limit()
    if cpu_has("amx_tile") and (limit == "ALL" or "AMX" in limit):
        return True
    allowed = limit == "ALL" or "BF16" in limit or "AMX" in limit
    return cpu_has("avx512_bf16") and allowed


def _onednn_vnni() -> bool:
    """Whether oneDNN's int8 kernels here sum u8 x s8 products in 32 bits (VNNI or AMX), not 16."""
    limit = _onednn_limit()
    if limit in ("AVX2", "AVX", "SSE41", "AVX512_CORE"):
        return False
    return cpu_has("vnni") or cpu_has("amx_tile")


def _onednn_bf16_output() -> bool:
    """Whether oneDNN's int8 matmul writes bfloat16 in its fast kernels here. Without AVX-512 it falls
    back to its reference code for a bf16 output (measured: ~100x slower), so an AVX2 CPU takes
    float32 out and rounds after the row scales."""
    global _bf16_out
    if _bf16_out is None:
        limit = _onednn_limit()
        below_avx512 = limit.startswith(("AVX2", "SSE")) or limit == "AVX"
        _bf16_out = cpu_has("avx512") and not below_avx512
    return _bf16_out


def int8_matmuls_available(device: torch.device) -> bool:
    """Whether `--quantization int8` runs int8 matmuls on this device: CUDA, or a CPU whose int8
    kernels sum in 32 bits (VNNI or AMX). Elsewhere the model keeps its bf16 weights."""
    return device.type != "cpu" or _onednn_vnni()


def quantize_linears_int8(
    model: nn.Module, quantize: Quantize, scale_rows: ScaleRows, small_for: CodesFor | None = None
) -> int:
    """Replace every plain linear by an Int8Linear; return the count. A CPU whose int8 kernels lack
    VNNI or AMX keeps its bf16 weights (int8 would be slower there, or inexact), saying so.
    `small_for` (ops.int8_matmul_for): the panel kernel where it runs, for every row count and the only
    copy of the codes."""
    sites = plain_linears(model)
    if sites and not int8_matmuls_available(sites[0][3].weight.device):
        log.warning("quantization int8 needs VNNI or AMX for its int8 matmuls; keeping bf16 weights")
        return 0
    for parent, name, _, child in sites:
        setattr(parent, name, Int8Linear(child, quantize, scale_rows, small_for))
    return len(sites)


def quantize_linears_int8_groups(
    model: nn.Module,
    group_for: GroupFor,
    quantize: Quantize,
    scale_rows: ScaleRows,
    small_for: CodesFor | None = None,
    codes: dict[str, Int8Groups] | None = None,
    per_channel: bool = True,
) -> int:
    """Replace every plain linear by a GroupInt8Linear (int8_scales="group"): from `codes` where given
    (by module name: a Q8_0 file's own), else from its weight quantized into groups; a layer the group
    panels do not take (K not a multiple of 32, a scale past float16) becomes a per-channel Int8Linear
    (unsmoothed: the group form's model is not), or with `per_channel` False stays as it is, with a
    warning. Returns the count of group layers. The caller checks that the group panels run here for
    this dtype (ops.group_panels_available, bfloat16; ops.group_wide_available, float32)."""
    sites = plain_linears(model)
    done = 0
    for parent, name, full, child in sites:
        layer = GroupInt8Linear.of(child, group_for, (codes or {}).get(full))
        if layer is None:
            how = "int8 per channel" if per_channel else "its weights kept"
            log.warning("%s: no group panels for its shape %s; %s", full, tuple(child.weight.shape), how)
            if per_channel:
                setattr(parent, name, Int8Linear(child, quantize, scale_rows, small_for))
            continue
        setattr(parent, name, layer)
        done += 1
    return done


def quantized_kernels_available(weight: torch.Tensor) -> bool:
    ops = torch.ops.aten
    return (
        weight.device.type == "cpu"
        and hasattr(ops, "_weight_int4pack_mm_for_cpu")
        and hasattr(ops, "_weight_int8pack_mm")
    )


def quantize_linears(
    model: nn.Module,
    max_rows: int,
    bits_for: dict[str, int],
    default_bits: int,
    quant_for: QuantFor | None = None,
    small_for: SmallFor | None = None,
    codes: dict[str, GroupCodes] | None = None,
    wide_for: WideFor | None = None,
) -> int:
    """Replace nn.Linear layers by QuantizedLinear (bits by module name, else default); return the count.
    `quant_for`: faster kernels for the quantized codes (ops.quantized_matmul_for); `small_for`: the few-row
    kernel of the bf16 copies (ops.small_matmul_for), when those fit SMALL_COPY_LIMIT_BYTES; `codes`: 4-bit
    codes by module name, taken as they are by the 4-bit layers they are given for."""
    sites = plain_linears(model, lambda _, child: quantized_kernels_available(child.weight))
    if small_for is not None and not small_copy_allowed(sites):
        small_for = None
    done = 0
    for parent, name, full, child in sites:
        bits = bits_for.get(full, default_bits)
        if bits == 4 and child.weight.shape[1] % GROUP:
            # Groups of 32 along the input: a width that is no multiple (a tiny expert) keeps its weights.
            log.warning("%s: %d inputs, not groups of %d; weights kept", full, child.weight.shape[1], GROUP)
            continue
        given = (codes or {}).get(full)
        setattr(parent, name, QuantizedLinear(child, bits, max_rows, quant_for, small_for, given, wide_for))
        done += 1
    return done


def _plain_linear(m: nn.Module) -> bool:
    """A linear still computed by a plain matmul of its weight (not yet packed or quantized)."""
    return isinstance(m, nn.Linear) or (isinstance(m, LinearBase) and not m.prepared)
