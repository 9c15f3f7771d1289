"""A linear with LoRA deltas for the adapters in memory, applied per segment of a step's rows.

It wraps whatever computes the base linear (bf16, packed, int4, int8, fp8: any LinearBase), so the delta
sits on every quantized form unchanged: y = base(x), then for each segment of rows on one adapter slot
y[rows, part] += (x[rows] A_slot^T) B_slot^T, scaling folded into B. The model runner orders each step's
rows by slot (decode rows among themselves, prompt chunks among themselves), so a step on four adapters
is about four segments whatever its batch, no weight is gathered or copied, and rows on the base model
cost nothing. On a CPU one kernel call computes a linear's deltas for every segment
(kernels/csrc/lora_delta.cpp); elsewhere two small matmuls per adapted part and segment do.

A fused linear (qkv, gate_up) is several adapted parts side by side in its output: their A matrices are
stacked so one matmul computes every part's shrink for a segment. Tensor parallelism cuts B's rows with
a column-parallel base and A's columns with a row-parallel one; the latter's delta is then a partial sum,
reduced with the base's output by the block's all-reduce.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from tokenmill.models.linear import LinearBase

# (first row, end row, slot) of a step's rows on an adapter, set by the model runner for the forward
# pass; shared by every LoRA linear of the model.
Segment = tuple[int, int, int]


NO_SEGMENTS = torch.zeros(0, 3, dtype=torch.long)


class StepSegments:
    """The step's segments (empty: no row on an adapter, and the deltas are skipped), as a list and as
    the [S, 3] tensor the CPU kernel reads."""

    def __init__(self) -> None:
        self.segments: list[Segment] = []
        self.tensor = NO_SEGMENTS

    def set(self, segments: list[Segment]) -> None:
        self.segments = segments
        self.tensor = torch.tensor(segments, dtype=torch.long) if segments else NO_SEGMENTS


# tokenmill's CPU kernel for the deltas of one linear (kernels/csrc/lora_delta.cpp):
# (y, x, a, [b per part], [first column per part], segments, active) -> None, y updated in place.
DeltaKernel = Callable[..., None]


class LoRALinear(LinearBase):
    prepared = True

    def __init__(
        self,
        base: torch.nn.Module,
        parts: list[tuple[int, int]],
        max_loras: int,
        max_rank: int,
        dtype: torch.dtype,
        device: torch.device,
        step: StepSegments,
        kernel: DeltaKernel | None = None,
    ) -> None:
        """`parts`: each adapted part's columns [start, end) of the output (one part for o_proj and
        down_proj, three for qkv, two for gate_up). With `kernel` (CPU) A and B are float32, which it
        computes in; without, PyTorch's matmuls compute in the model's `dtype`."""
        super().__init__()
        self.base = base
        self.in_features, self.out_features = base.in_features, base.out_features
        self.parts = parts
        self.rank = max_rank
        self.kernel = kernel
        dtype = torch.float32 if kernel is not None else dtype
        n = len(parts)
        # A transposed, slot-major: slot s's shrink for every part is one matmul with a[s] ([in, n * R]).
        self.a = torch.zeros(max_loras, self.in_features, n * max_rank, dtype=dtype, device=device)
        # Part i's expand for slot s: b[i][s] ([R, part width]), scaling folded in.
        self.b = [torch.zeros(max_loras, max_rank, hi - lo, dtype=dtype, device=device) for lo, hi in parts]
        self.lo = [lo for lo, _ in parts]
        # Per slot, the parts its adapter adapts (the others are skipped); empty: a free slot.
        self.slot_parts: list[list[int]] = [[] for _ in range(max_loras)]
        self.active = torch.zeros(max_loras, n, dtype=torch.uint8)  # the same, for the kernel
        self.step = step
        self._base = base.forward

    def set_slot(self, slot: int, deltas: list[tuple[torch.Tensor, torch.Tensor, float] | None]) -> None:
        """Slot `slot` takes an adapter: per part (A [r, in], B [part width, r], scaling), already cut to
        this rank's share, or None where the adapter leaves the part alone."""
        r_max = self.rank
        self.a[slot].zero_()
        for i, d in enumerate(deltas):
            self.b[i][slot].zero_()
            if d is None:
                continue
            a, b, scaling = d
            r = a.shape[0]
            self.a[slot, :, i * r_max : i * r_max + r].copy_(a.t())
            self.b[i][slot, :r].copy_((b.float() * scaling).t())
        self.slot_parts[slot] = [i for i, d in enumerate(deltas) if d is not None]
        self.active[slot] = torch.tensor([d is not None for d in deltas], dtype=torch.uint8)

    def clear_slot(self, slot: int) -> None:
        self.slot_parts[slot] = []
        self.active[slot] = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self._base(x)
        step = self.step
        if not step.segments:
            return y
        if self.kernel is not None and x.stride(-1) == 1 and y.stride(-1) == 1 and x.dim() == 2:
            self.kernel(y, x, self.a, self.b, self.lo, step.tensor, self.active)
            return y
        r = self.rank
        for start, end, slot in step.segments:
            parts = self.slot_parts[slot]
            if not parts:
                continue
            rows = x[start:end]
            a = self.a[slot] if self.a.dtype == x.dtype else self.a[slot].to(x.dtype)
            shrink = rows @ a  # [rows, parts * R]
            out = y[start:end]
            for i in parts:
                lo, hi = self.parts[i]
                b = self.b[i][slot] if self.b[i].dtype == x.dtype else self.b[i][slot].to(x.dtype)
                out[:, lo:hi].addmm_(shrink[:, i * r : (i + 1) * r], b)
        return y
