"""The element-wise parts of a Llama block, in two implementations with one interface.

`TorchOps` is plain PyTorch and defines the semantics. `CpuFusedOps` runs each op as one C++ loop
(tokenmill/kernels/csrc/fused_ops.cpp): fewer passes over memory and fewer thread-pool wake-ups,
which is where a small model's CPU step time goes once the matmuls are fast.
"""

from __future__ import annotations

import logging

import torch
import torch.nn.functional as F

from tokenmill.models.fp8_linear import to_e4m3
from tokenmill.models.linear import amx_brgemm_available

log = logging.getLogger(__name__)


class TorchOps:
    name = "torch"

    def rms_norm(self, x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
        return F.rms_norm(x, w.shape, w, eps)

    def add_rms_norm(
        self, x: torch.Tensor, residual: torch.Tensor, w: torch.Tensor, eps: float
    ) -> torch.Tensor:
        """residual += x (in place); return rms_norm(residual)."""
        residual.add_(x)
        return F.rms_norm(residual, w.shape, w, eps)

    def silu_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        gate, up = gate_up.chunk(2, dim=-1)
        return F.silu(gate) * up

    def rope_(
        self,
        qkv: torch.Tensor,
        heads: int,
        head_dim: int,
        positions: torch.Tensor,
        cos: torch.Tensor,
        sin_signed: torch.Tensor,
    ) -> None:
        """Rotate the first `heads` heads of each row in place (x*cos + roll(x, D/2)*sin_signed)."""
        t = qkv.shape[0]
        x = qkv[:, : heads * head_dim].view(t, heads, head_dim)
        c = cos[positions].unsqueeze(1).to(x.dtype)
        s = sin_signed[positions].unsqueeze(1).to(x.dtype)
        x.copy_(x * c + x.roll(head_dim // 2, dims=-1) * s)

    def quantize_rows_u8(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Each row as integers q in [-127, 127] with one float32 scale (max|x| / 127), stored as
        uint8 q + 128 (zero point 128, the form oneDNN's int8 kernels are fast for): (q + 128 [M, K]
        uint8, scales [M, 1] float32)."""
        s = (x.abs().amax(dim=1, keepdim=True).float() / 127).clamp(min=torch.finfo(torch.float32).tiny)
        return (torch.round(x.float() / s).clamp(-127, 127) + 128).to(torch.uint8), s

    def scale_rows_(self, y: torch.Tensor, scales: torch.Tensor) -> None:
        """y[r, :] *= scales[r] in place, computed in float32 and rounded to y's dtype once."""
        y.copy_(y.float() * scales)

    def e4m3_rows(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Each row as float8 e4m3 codes at one float32 scale (max|x| / 448), the codes held in bfloat16
        (exact: 4 significant bits): (codes [M, K] bf16, scales [M, 1] float32)."""
        codes, s = to_e4m3(x, dim=1)
        return codes.to(torch.bfloat16), s

    def scale_rows_cols(
        self, y: torch.Tensor, rows: torch.Tensor, cols: torch.Tensor, dtype: torch.dtype
    ) -> torch.Tensor:
        """y * rows[r] * cols[c] in float32, rounded once to `dtype` (rows [M, 1], cols [1, N])."""
        return (y.float() * rows * cols).to(dtype)

    def sample_rows(self, logits: torch.Tensor, temps: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
        """A token per row of `logits` [R, V] at temperature temps[r] (> 0): the first token whose
        cumulative probability reaches u[r] in (0, 1]. p_i = exp((x_i - max) / T), terms below exp(-87)
        taken as 0 (a masked token is never drawn). -1 for a row that is no distribution (a NaN, a
        +inf, every token masked)."""
        x = logits.float()
        m = x.amax(dim=-1, keepdim=True)
        t = (x - m) / temps.unsqueeze(1)
        p = torch.where(t < -87, torch.zeros_like(t), t.exp())
        cdf = p.cumsum(dim=-1)
        total = cdf[:, -1:]
        tokens = torch.searchsorted(cdf, u.unsqueeze(1) * total)[:, 0].clamp_(max=x.shape[-1] - 1)
        bad = ~torch.isfinite(m[:, 0]) | ~torch.isfinite(total[:, 0]) | (total[:, 0] < 1)
        return tokens.masked_fill_(bad, -1)

    def argmax_rows(self, logits: torch.Tensor) -> torch.Tensor:
        """Each row's first maximum (a NaN counts as the largest): greedy decoding's token."""
        # max().indices, not argmax(): the same first-maximum index, ~3x faster on CPU.
        return logits.max(dim=-1).indices

    def small_matmul_for(self, weight: torch.Tensor) -> PanelMatmul | None:
        """A matmul kernel for decode steps of few rows (on some CPUs every step: panels_take_every_row)
        with this [N, K] weight, or None (the plain path has none)."""
        return None

    def panels_take_every_row(self) -> bool:
        """Whether small_matmul_for's kernels (for bf16 CPU weights) take steps of any number of rows, so
        that a linear keeps them as its only copy of the weight rather than beside oneDNN's."""
        return False

    def quantized_matmul_for(
        self,
        bits: int,
        q: torch.Tensor,
        scale: torch.Tensor,
        lo: torch.Tensor | None,
        int8_activations: bool = False,
        float32_rows: bool = False,
    ) -> Q4Panels | Q4WidePanels | Q8Panels | None:
        """A kernel for steps of up to its max_rows rows (None: any) with weight-only quantized weights,
        or None (PyTorch's int4/int8 matmuls are used): 4 bits, w = q * scale + lo (q [N, K] in 0..15,
        scale and lo [N, K/32]); 8 bits, w = q * scale (q [N, K] int8, scale [N]). `int8_activations`:
        4-bit steps above 2 rows quantize their activations to int8 (W4A8)."""
        return None

    def fp8_matmul_for(self, codes: torch.Tensor, scale: torch.Tensor) -> F8Panels | None:
        """A kernel for fp8 steps of up to `max_rows` rows with these e4m3 weight codes (codes [N, K]
        float8_e4m3fn, scale [N] float32), or None (the bf16 matmul of the codes is used)."""
        return None

    def group_panels_available(self) -> bool:
        """Whether group_int8_matmul_for gives kernels here (for a weight whose K is a multiple of 32)."""
        return False

    def group_wide_available(self) -> bool:
        """Whether group_int8_matmul_for gives kernels for float32 rows here (float32_rows=True)."""
        return False

    def group_int8_matmul_for(
        self, q: torch.Tensor, scale: torch.Tensor, wide_rows: int = 0, float32_rows: bool = False
    ) -> G8Panels | G8WidePanels | None:
        """A kernel for W8A8 steps of any number of rows with int8 weight codes in groups of 32 k (q [N, K],
        scale [N, K/32] float32 values float16 holds: a Q8_0 block's), the activations quantized per row
        and group of 32 as the step runs (to 16 bits in steps of up to `wide_rows` rows: G8Panels); with
        `float32_rows`, for a float32 model's rows (G8WidePanels); or None (the layer is then quantized
        otherwise)."""
        return None

    def int8_matmul_for(self, q: torch.Tensor, scale: torch.Tensor) -> I8Panels | None:
        """A kernel for W8A8 steps of up to `max_rows` rows with these int8 weight codes (q [N, K], scale
        [N] float32), or None (oneDNN's int8 matmul, or the float path, is used)."""
        return None


class PanelMatmul:
    """x @ W^T for up to `max_rows` rows by the C++ panel kernels (kernels/csrc/panel_matmul.cpp), W
    held as their panels. Which loops, by CPU:

    - AMX (Intel Xeon): vector loops up to 2 rows, oneDNN's brgemm per panel up to 96. All of
      SmolLM2-135M's linears against oneDNN's packed matmul, same process: the vector loops 1.5x at 1-2
      rows; brgemm 1.36x at 4-8 rows, 1.24-1.31x at 16-32, 1.11-1.18x at 64-96, 0.96x at 128 (in the
      model 1 stream 1.41x a token, 32 streams offline 1.15-1.16x tokens/s).
    - AVX512-BF16 without AMX (AMD Zen 4): the dot loops (vdpbf16ps) for every step, 256 rows a sweep of
      the weights: 1.8-2.0x oneDNN at 1-8 rows, 1.3-1.6x at 16-32, 1.2-1.3x at 64, 1.08x at 256, 1.02-1.07x
      at 512-2048 (a prompt's chunk), so no oneDNN copy is kept there (max_rows None). Each row is summed
      in the same order whatever the step's size, so a row's output does not depend on its neighbours.
    - otherwise (AVX-512 without BF16, AVX2): vector loops up to 4 rows."""

    def __init__(self, k: object, weight: torch.Tensor, brgemm: bool) -> None:
        self.k, self.n = k, weight.shape[0]
        self.panels = k.panel_pack(weight)  # type: ignore[attr-defined]
        self.dot = not brgemm and bool(k.panel_dot_available())  # type: ignore[attr-defined]
        self.vector_rows = 2 if brgemm else 4
        self.max_rows: int | None = None if self.dot else 96 if brgemm else 4

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.dot and x.dtype == torch.bfloat16:
            return self.k.panel_matmul_dot(x, self.panels, self.n)  # type: ignore[attr-defined]
        return self.k.panel_matmul(x, self.panels, self.n, self.vector_rows)  # type: ignore[attr-defined]


def q4_pack(q: torch.Tensor, scale: torch.Tensor, lo: torch.Tensor | None) -> torch.Tensor:
    """4-bit codes q [N, K] (0..15) with their per-32-k scales and minima [N, K/32] as the panels of
    kernels/csrc/panel_q4.cpp: [ceil(N/32), K/32, 640] bytes, per panel and group 8 k quads of 64 bytes
    (byte 4j + t: column j's code at k = 4 * quad + t in the low nibble, column 16 + j's in the high one),
    then 32 float16 scales and 32 float16 minima. `lo` None: every minimum is -8 scale (a Q4_0 block's),
    and the panels leave them out, [ceil(N/32), K/32, 576]. Columns past N are zero."""
    n, k = q.shape
    panels, groups, pad = -(-n // 32), k // 32, -n % 32
    q = torch.nn.functional.pad(q.to(torch.uint8), (0, 0, 0, pad)).view(panels, 2, 16, groups, 8, 4)
    codes = (q[:, 0] | (q[:, 1] << 4)).permute(0, 2, 3, 1, 4).reshape(panels, groups, 512)

    def per_group(v: torch.Tensor) -> torch.Tensor:
        v = torch.nn.functional.pad(v.float(), (0, 0, 0, pad)).view(panels, 32, groups).permute(0, 2, 1)
        return v.to(torch.float16).contiguous().view(torch.uint8)

    parts = [codes, per_group(scale)] + ([] if lo is None else [per_group(lo)])
    return torch.cat(parts, -1).contiguous()


def q4_symmetric(scale: torch.Tensor, lo: torch.Tensor) -> bool:
    """Whether every minimum is -8 scale as the 4-bit panels hold them (in float16): the form without
    minima then gives the same bits as the one with them, from 10% fewer bytes."""
    return torch.equal(lo.to(torch.float16).float(), scale.to(torch.float16).float() * -8)


def g8_pack(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """8-bit codes q [N, K] (-128..127) with their per-32-k scales [N, K/32] (a Q8_0 block's) as the
    panels of kernels/csrc/panel_g8.cpp: [ceil(N/32), K/32, 1088] bytes, per panel and group 8 k quads of
    128 bytes (byte 4j + t of the first 64: column j's q + 128 at k = 4 * quad + t; of the last 64: column
    16 + j's), then 32 float16 scales. Columns past N have code 0 and scale 0."""
    n, k = q.shape
    panels, groups, pad = -(-n // 32), k // 32, -n % 32
    biased = (q.to(torch.int16) + 128).to(torch.uint8)
    biased = torch.nn.functional.pad(biased, (0, 0, 0, pad), value=128).reshape(panels, 2, 16, groups, 8, 4)
    codes = biased.permute(0, 3, 4, 1, 2, 5).reshape(panels, groups, 1024)
    scales = torch.nn.functional.pad(scale.float(), (0, 0, 0, pad)).reshape(panels, 32, groups)
    scales = scales.permute(0, 2, 1)
    return torch.cat([codes, scales.to(torch.float16).contiguous().view(torch.uint8)], -1).contiguous()


def column_scales(scale: torch.Tensor) -> torch.Tensor:
    """Per-column float32 scales [N] padded to whole 32-column panels (0 past N), as the kernels read them."""
    scale = scale.float().flatten()
    return torch.nn.functional.pad(scale, (0, -scale.numel() % 32)).contiguous()


class G8WidePanels:
    """W8A8 x @ W^T for any number of float32 (or bf16) rows with W as int8 codes and a scale per group of
    32 k (g8_pack's panels, as G8Panels holds them) on builds without the BF16 loops (AVX2): the rows
    quantized to int8 per group of 32 and multiplied by vpmaddubsw with the sign trick (as llama.cpp
    multiplies Q8_0 by Q8_0 on AVX2), the rows' dtype out (kernels/csrc/panel_g8_wide.cpp)."""

    max_rows: int | None = None  # every row count

    def __init__(self, k: object, q: torch.Tensor, scale: torch.Tensor) -> None:
        self.k, self.n = k, q.shape[0]
        self.panels = g8_pack(q, scale)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        y = self.k.g8_matmul_wide(x, self.panels, self.n)  # type: ignore[attr-defined]
        return y if y.dtype == x.dtype else y.to(x.dtype)


class Q4WidePanels:
    """x @ W^T for up to 4 rows with W in 4 bits (q4_pack's panels, as Q4Panels holds them) on builds
    without the BF16 loops (AVX2): the rows quantized to int8 per group of 32 and multiplied by
    vpmaddubsw (W4A8, as llama.cpp multiplies Q4 by Q8_0 on AVX2), float32 or bf16 rows in, the rows'
    dtype out (kernels/csrc/panel_q4_wide.cpp). Larger steps take the layer's copy."""

    max_rows: int | None = 4
    any_dtype = True  # QuantizedLinear hands it float32 rows as they are
    int8_activations = True

    def __init__(self, k: object, q: torch.Tensor, scale: torch.Tensor, lo: torch.Tensor) -> None:
        self.k, self.n = k, q.shape[0]
        self.panels = q4_pack(q, scale, None if q4_symmetric(scale, lo) else lo)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        y = self.k.q4_matmul_wide(x, self.panels, self.n)  # type: ignore[attr-defined]
        return y if y.dtype == x.dtype else y.to(x.dtype)


class Q4Panels:
    """x @ W^T for any number of bfloat16 rows with W in 4 bits (groups of 32, scale and minimum: a Q4
    GGUF block), by kernels/csrc/panel_q4.cpp (AVX512-BF16 builds only): the codes in 32-column panels
    read as one stream, so the layer needs no bf16 copy for larger steps or prompts. The activations
    stay bf16 (W4A16: up to 16 rows each code becomes the bf16 number 128 + q and vdpbf16ps gives
    exact products; above, each panel is dequantized to bf16 once per sweep), or with
    `int8_activations` above 2 rows are quantized to int8 per row and group of 32 and multiplied by
    vpdpbusd (W4A8: faster from 3 rows, less accurate). Weights whose minima are all -8 x their
    scales (a Q4_0 file's) are held without them, 10% fewer bytes for the same bits. AMD Zen 4
    figures: docs/history/benchmarks.md."""

    max_rows: int | None = None  # every row count

    def __init__(
        self,
        k: object,
        q: torch.Tensor,
        scale: torch.Tensor,
        lo: torch.Tensor,
        int8_activations: bool = False,
    ) -> None:
        self.k, self.n = k, q.shape[0]
        # A Q4_0 file's weights (w = (q - 8) scale) need no minima: 4.5 bits a weight rather than 5.
        self.panels = q4_pack(q, scale, None if q4_symmetric(scale, lo) else lo)
        self.int8_activations = int8_activations
        # The kernel keeps bf16 activations up to exact_rows rows: one or two streams' decode steps, where
        # W4A8 is only 1.02-1.04x faster (AMD Zen 4, 1.7B shape), stay exact; from 3 rows it is 1.3-1.5x.
        self.exact_rows = 2 if int8_activations else 2**62

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return self.k.q4_matmul(x, self.panels, self.n, self.exact_rows)  # type: ignore[attr-defined]


class Q8Panels:
    """x @ W^T for any number of bfloat16 rows with W as int8 codes and a scale per output column
    (weight-only: the int4 model's output head where the group panels do not take it, as G8Panels do
    where they run), by kernels/csrc/panel_q8.cpp over the codes in the bf16
    panel layout (AVX512-BF16 builds only): exact products up to 4 rows; above, each panel dequantized to
    bf16 once per sweep of 256 rows, so the layer needs no bf16 copy."""

    max_rows: int | None = None  # every row count

    def __init__(self, k: object, q: torch.Tensor, scale: torch.Tensor) -> None:
        self.k, self.n = k, q.shape[0]
        self.panels = k.panel_pack(q.to(torch.int8).contiguous())  # type: ignore[attr-defined]
        self.scales = column_scales(scale)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return self.k.q8_matmul(x, self.panels, self.scales, self.n)  # type: ignore[attr-defined]


class G8Panels:
    """W8A8 x @ W^T for any number of bfloat16 rows with W as int8 codes and a scale per group of 32 k (a
    Q8_0 GGUF block), by kernels/csrc/panel_g8.cpp (AVX512-BF16 builds, which have VNNI): the
    activations quantized per row and group of 32 as the step runs, the codes' products summed exactly
    by vpdpbusd per group and scaled in float32, as llama.cpp multiplies Q8_0 by Q8_0. Steps of up to
    `wide_rows` rows take 16-bit activation codes instead (a power-of-two scale: every element within
    2^7 of its group's largest exactly, the rest to 2^-15 of it), summed by vpdpwssd: as fast as the
    8-bit codes up to 2 rows, 0.64x of their speed at 32 (AMD Zen 4), the precision of bf16 activations;
    int4's output head takes them at every row count (models/quant/int4.py, Int4._head_in_groups)."""

    max_rows: int | None = None  # every row count

    def __init__(self, k: object, q: torch.Tensor, scale: torch.Tensor, wide_rows: int = 0) -> None:
        self.k, self.n = k, q.shape[0]
        self.panels = g8_pack(q, scale)
        self.wide_rows = wide_rows

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return self.k.g8_matmul(x, self.panels, self.n, self.wide_rows)  # type: ignore[attr-defined]


class I8Panels:
    """W8A8 x @ W^T for any number of rows by kernels/csrc/panel_i8.cpp: uint8 activation codes (q + 128, as
    quantize_rows_u8 leaves them) times the int8 weight codes by vpdpbusd, the integer sums exact in int32,
    scaled by each row's and each column's scale in float32 and rounded once to bfloat16 (AVX512-BF16
    builds, which have VNNI). Used where oneDNN's int8 matmul was measured slower (AMD Zen 4, no AMX): at
    1-256 rows, and at 512-2048 (a prompt's chunk, 256 rows a sweep) 1.05-1.08x, so no oneDNN copy is kept."""

    max_rows: int | None = None  # every row count

    def __init__(self, k: object, q: torch.Tensor, scale: torch.Tensor) -> None:
        self.k, self.n = k, q.shape[0]
        q = q.to(torch.int8).contiguous()
        self.panels = k.panel_pack(q, 4)  # type: ignore[attr-defined]
        # The activations arrive as q + 128: 128 x a column's code sum comes off its integer sum (int32:
        # at most 128 x 127 x K).
        offsets = 128 * q.sum(1, dtype=torch.int32)
        self.offsets = torch.nn.functional.pad(offsets, (0, -self.n % 32)).contiguous()
        self.scales = column_scales(scale)

    def __call__(self, xq: torch.Tensor, x_scales: torch.Tensor) -> torch.Tensor:
        return self.k.i8_matmul(xq, x_scales, self.panels, self.offsets, self.scales, self.n)  # type: ignore[attr-defined]


class F8Panels:
    """fp8 x @ W^T for any number of rows (256 a sweep) by kernels/csrc/panel_f8.cpp: the activations'
    e4m3 codes (held in bf16, as e4m3_rows leaves them) times the weights' e4m3 codes kept one byte each,
    widened to bf16 as they stream in (up to 8 rows; more rows widen each panel once a sweep into a
    buffer) and multiplied by vdpbf16ps (exact products, float32 sums), scaled by each row's and each
    column's scale and rounded once (AVX512-BF16 builds). Half the bytes of the bf16 path; used where the
    dot loops are (AVX512-BF16 without AMX), at every row count (1.03-1.27x the bf16 copy of the codes at
    512-2048 rows, which is then not kept)."""

    max_rows: int | None = None  # every row count

    def __init__(self, k: object, codes: torch.Tensor, scale: torch.Tensor) -> None:
        self.k, self.n = k, codes.shape[0]
        self.panels = k.panel_pack(codes.contiguous().view(torch.int8))  # type: ignore[attr-defined]
        self.scales = column_scales(scale)

    def __call__(self, x_codes: torch.Tensor, x_scales: torch.Tensor) -> torch.Tensor:
        k = self.k
        return k.f8_matmul(x_codes, x_scales, self.panels, self.scales, self.n)  # type: ignore[attr-defined]


class CpuFusedOps(TorchOps):
    name = "cpu"

    def __init__(self, level: str | None = None) -> None:
        """`level`: an instruction-set build of the kernels (tokenmill/kernels/isa.py); default the best."""
        from tokenmill.kernels import cpu_kernels

        self.k = cpu_kernels(level)

    def rms_norm(self, x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
        return self.k.rms_norm(x, w, eps)

    def add_rms_norm(
        self, x: torch.Tensor, residual: torch.Tensor, w: torch.Tensor, eps: float
    ) -> torch.Tensor:
        return self.k.add_rms_norm(x, residual, w, eps)

    def silu_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        return self.k.silu_mul(gate_up)

    def rope_(
        self,
        qkv: torch.Tensor,
        heads: int,
        head_dim: int,
        positions: torch.Tensor,
        cos: torch.Tensor,
        sin_signed: torch.Tensor,
    ) -> None:
        self.k.rope_(qkv, heads, head_dim, positions, cos, sin_signed)

    def quantize_rows_u8(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        q, s = self.k.quantize_rows_u8(x)
        return q, s

    def scale_rows_(self, y: torch.Tensor, scales: torch.Tensor) -> None:
        self.k.scale_rows_(y, scales)

    def e4m3_rows(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        q, s = self.k.e4m3_rows_bf16(x)
        return q, s

    def scale_rows_cols(
        self, y: torch.Tensor, rows: torch.Tensor, cols: torch.Tensor, dtype: torch.dtype
    ) -> torch.Tensor:
        return self.k.scale_rows_cols(y, rows, cols, dtype)

    def sample_rows(self, logits: torch.Tensor, temps: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
        return self.k.sample_rows(logits, temps, u)

    def argmax_rows(self, logits: torch.Tensor) -> torch.Tensor:
        if logits.dim() != 2 or logits.stride(-1) != 1 or logits.shape[-1] == 0:
            return super().argmax_rows(logits)
        return self.k.argmax_rows(logits)

    def small_matmul_for(self, weight: torch.Tensor) -> PanelMatmul | None:
        if weight.dtype != torch.bfloat16 or weight.device.type != "cpu" or weight.dim() != 2:
            return None
        if weight.shape[1] % 2:  # the panels pair k
            return None
        return PanelMatmul(self.k, weight, amx_brgemm_available())

    def panels_take_every_row(self) -> bool:
        return bool(self.k.panel_dot_available()) and not amx_brgemm_available()

    def _dot_loops_for(self, codes: torch.Tensor, k_multiple: int) -> bool:
        """Whether the panel kernels of the dot-loop family (the bf16 dot loops, 4-bit, 8-bit, W8A8 and fp8
        panels) take this [N, K] weight: a CPU tensor with K a multiple of the kernel's k grouping, in an
        AVX512-BF16 build on a CPU without AMX. Measured there only (AMD Zen 4); with AMX the bf16 panels
        take brgemm and the others are left to oneDNN and PyTorch, unmeasured against them."""
        if codes.device.type != "cpu" or codes.dim() != 2 or codes.shape[1] % k_multiple:
            return False
        return bool(self.k.panel_dot_available()) and not amx_brgemm_available()

    def quantized_matmul_for(
        self,
        bits: int,
        q: torch.Tensor,
        scale: torch.Tensor,
        lo: torch.Tensor | None,
        int8_activations: bool = False,
        float32_rows: bool = False,
    ) -> Q4Panels | Q4WidePanels | Q8Panels | None:
        if not self._dot_loops_for(q, 32):  # 4-bit groups of 32
            wide = bits == 4 and lo is not None and int8_activations and float32_rows
            if wide and self._wide_loops_for(q, scale, lo) and self.k.q4_wide_available():  # type: ignore[attr-defined]
                return Q4WidePanels(self.k, q, scale, lo)
            return None
        if bits == 4 and lo is not None:
            if not _fit_float16(scale, lo):
                return None  # the panels hold float16 scales and minima
            return Q4Panels(self.k, q, scale, lo, int8_activations)
        return Q8Panels(self.k, q, scale) if bits == 8 else None

    def _wide_loops_for(self, q: torch.Tensor, *scales: torch.Tensor) -> bool:
        """Whether the AVX2 loops for a float32 model's rows (4-bit and 8-bit, by vpmaddubsw) may take
        this [N, K] weight: a build without the BF16 loops (those have their own panels), a CPU tensor
        with K a multiple of 32, scales that float16 holds."""
        if q.device.type != "cpu" or q.dim() != 2 or q.shape[1] % 32 or self.k.panel_dot_available():
            return False
        return _fit_float16(*scales)

    def fp8_matmul_for(self, codes: torch.Tensor, scale: torch.Tensor) -> F8Panels | None:
        return F8Panels(self.k, codes, scale) if self._dot_loops_for(codes, 2) else None

    def group_panels_available(self) -> bool:
        return self._dot_loops_for(torch.empty(0, 32), 32)

    def group_wide_available(self) -> bool:
        return self._wide_loops_for(torch.empty(0, 32)) and bool(self.k.g8_wide_available())  # type: ignore[attr-defined]

    def group_int8_matmul_for(
        self, q: torch.Tensor, scale: torch.Tensor, wide_rows: int = 0, float32_rows: bool = False
    ) -> G8Panels | G8WidePanels | None:
        if float32_rows:
            taken = self._wide_loops_for(q, scale) and self.k.g8_wide_available()  # type: ignore[attr-defined]
            return G8WidePanels(self.k, q, scale) if taken else None
        if not self._dot_loops_for(q, 32) or not _fit_float16(scale):
            return None  # the panels hold float16 scales
        return G8Panels(self.k, q, scale, wide_rows)

    def int8_matmul_for(self, q: torch.Tensor, scale: torch.Tensor) -> I8Panels | None:
        return I8Panels(self.k, q, scale) if self._dot_loops_for(q, 4) else None  # vpdpbusd groups 4 k


def _fit_float16(*scales: torch.Tensor) -> bool:
    """Whether every value fits float16's range (the panels store their group scales in float16)."""
    return all(float(t.abs().max()) <= torch.finfo(torch.float16).max for t in scales if t.numel())


def get_ops(name: str, device_type: str) -> TorchOps:
    """ "torch", "cpu" (fused C++ at the best instruction-set level this CPU runs), a level name
    (tokenmill/kernels/isa.py, e.g. "avx2": that build, for testing the paths other CPUs take), or
    "auto": fused on a CPU when the kernels build, else torch with a one-line warning."""
    from tokenmill.kernels.isa import level_names

    if name not in ("auto", "torch", "cpu", *level_names()):
        raise ValueError(f"unknown kernels {name!r}; available: auto, torch, cpu, {', '.join(level_names())}")
    if name == "torch" or (name == "auto" and device_type != "cpu"):
        return TorchOps()
    try:
        return CpuFusedOps(None if name in ("auto", "cpu") else name)
    except RuntimeError as e:
        if name != "auto":
            raise
        log.warning("%s; using plain PyTorch ops", e)
        return TorchOps()
