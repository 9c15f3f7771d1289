"""Where a worker stands in a tensor x pipeline parallel group, and the collectives it uses.

Ranks are laid out stage by stage: global rank = pp_rank * tp_size + tp_rank, so the tensor-parallel
ranks of one pipeline stage are neighbours. The backend follows the device (gloo on CPU, nccl on
CUDA). A single worker is the same object with sizes 1, and every collective is then a no-op.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist


def backend_for(device: torch.device) -> str:
    return "nccl" if device.type == "cuda" else "gloo"


@dataclass
class ParallelState:
    tp_size: int = 1
    tp_rank: int = 0
    pp_size: int = 1
    pp_rank: int = 0
    tp_group: Any = None  # the torch.distributed group of this stage's tensor-parallel ranks

    @classmethod
    def single(cls) -> ParallelState:
        return cls()

    @classmethod
    def from_initialized(cls, tp_size: int, pp_size: int, rank: int) -> ParallelState:
        """After torch.distributed.init_process_group: build the TP groups (every rank calls this)."""
        groups = [dist.new_group(list(range(s * tp_size, (s + 1) * tp_size))) for s in range(pp_size)]
        pp_rank, tp_rank = divmod(rank, tp_size)
        return cls(tp_size, tp_rank, pp_size, pp_rank, groups[pp_rank])

    @property
    def rank(self) -> int:
        return self.pp_rank * self.tp_size + self.tp_rank

    @property
    def is_first_stage(self) -> bool:
        return self.pp_rank == 0

    @property
    def is_last_stage(self) -> bool:
        return self.pp_rank == self.pp_size - 1

    @property
    def samples(self) -> bool:
        """The one rank that samples and answers the engine: the last stage's first TP rank."""
        return self.is_last_stage and self.tp_rank == 0

    # -- tensor parallel --------------------------------------------------------------------------
    def all_reduce(self, t: torch.Tensor) -> torch.Tensor:
        """Sum partial results over the TP ranks, in place. bf16/fp16 partials are summed in float32,
        so the sum is rounded once, as the single-process matmul rounds its output once."""
        if self.tp_size == 1:
            return t
        if t.dtype in (torch.bfloat16, torch.float16):
            wide = t.float()
            dist.all_reduce(wide, group=self.tp_group)
            t.copy_(wide)
        else:
            dist.all_reduce(t, group=self.tp_group)
        return t

    def all_gather_last_dim(self, t: torch.Tensor, sizes: list[int]) -> torch.Tensor:
        """Concatenate each TP rank's slice along the last dimension (slices may differ by one)."""
        if self.tp_size == 1:
            return t
        width = max(sizes)
        if t.shape[-1] < width:
            t = torch.nn.functional.pad(t, (0, width - t.shape[-1]))
        parts = [torch.empty_like(t) for _ in range(self.tp_size)]
        dist.all_gather(parts, t.contiguous(), group=self.tp_group)
        return torch.cat([p[..., :n] for p, n in zip(parts, sizes, strict=True)], dim=-1)

    def any_rank(self, flag: bool) -> bool:
        """Whether `flag` is true on any rank of the engine, every stage's (all ranks must call it)."""
        if self.tp_size * self.pp_size == 1:
            return flag
        device = "cuda" if dist.get_backend() == "nccl" else "cpu"  # NCCL reduces device tensors only
        t = torch.tensor([int(flag)], device=device)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return bool(t.item())

    # -- pipeline parallel ----------------------------------------------------------------------
    def send_activations(self, t: torch.Tensor) -> None:
        # Each TP rank hands its (identical, all-reduced) copy to the same TP rank of the next stage.
        dist.send(t.contiguous(), dst=self.rank + self.tp_size)

    def recv_activations(
        self, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device
    ) -> torch.Tensor:
        t = torch.empty(shape, dtype=dtype, device=device)
        dist.recv(t, src=self.rank - self.tp_size)
        return t
