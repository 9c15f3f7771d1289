"""A linear with LoRA deltas for the adapters in memory, applied per segment of a step's rows.

It wraps whatever computes the base linear (bf16, packed, int4, int8, fp8: any LinearBase), so the delta
sits on every quantized form unchanged: y = base(x), then for each segment of rows on one adapter slot
y[rows, part] += (x[rows] A_slot^T) B_slot^T, scaling folded into B. The model runner orders each step's
rows by slot (decode rows among themselves, prompt chunks among themselves), so a step on four adapters
is about four segments whatever its batch: two small matmuls per adapted part and segment, no gathered
copy of any weight, and rows on the base model cost nothing.

A fused linear (qkv, gate_up) is several adapted parts side by side in its output: their A matrices are
stacked so one matmul computes every part's shrink for a segment. Tensor parallelism cuts B's rows with
a column-parallel base and A's columns with a row-parallel one; the latter's delta is then a partial sum,
reduced with the base's output by the block's all-reduce.
"""

from __future__ import annotations

import torch

from tokenmill.models.linear import LinearBase

# (first row, end row, slot) of a step's rows on an adapter, set by the model runner for the forward
# pass; shared by every LoRA linear of the model.
Segment = tuple[int, int, int]


class StepSegments:
    """The step's segments (empty: no row on an adapter, and the deltas are skipped)."""

    def __init__(self) -> None:
        self.segments: list[Segment] = []


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
    ) -> None:
        """`parts`: each adapted part's columns [start, end) of the output (one part for o_proj and
        down_proj, three for qkv, two for gate_up)."""
        super().__init__()
        self.base = base
        self.in_features, self.out_features = base.in_features, base.out_features
        self.parts = parts
        self.rank = max_rank
        n = len(parts)
        # Slot-major: slot s's shrink for every part is one matmul with a[s] ([n * R, in]).
        self.a = torch.zeros(max_loras, n * max_rank, self.in_features, dtype=dtype, device=device)
        # Part i's expand for slot s: b[i][s] ([R, part width]), scaling folded in.
        self.b = [torch.zeros(max_loras, max_rank, hi - lo, dtype=dtype, device=device) for lo, hi in parts]
        # Per slot, the parts its adapter adapts (the others are skipped); empty: a free slot.
        self.slot_parts: list[list[int]] = [[] for _ in range(max_loras)]
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
            self.a[slot, i * r_max : i * r_max + r].copy_(a)
            self.b[i][slot, :r].copy_((b.float() * scaling).t())
        self.slot_parts[slot] = [i for i, d in enumerate(deltas) if d is not None]

    def clear_slot(self, slot: int) -> None:
        self.slot_parts[slot] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self._base(x)
        segments = self.step.segments
        if not segments:
            return y
        r = self.rank
        for start, end, slot in segments:
            parts = self.slot_parts[slot]
            if not parts:
                continue
            rows = x[start:end]
            shrink = rows @ self.a[slot].t()  # [rows, parts * R]
            out = y[start:end]
            for i in parts:
                lo, hi = self.parts[i]
                out[:, lo:hi].addmm_(shrink[:, i * r : (i + 1) * r], self.b[i][slot])
        return y
