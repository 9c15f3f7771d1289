"""A model's LoRA slots on one worker: every decoder layer's linears wrapped (lora/layer.py), and
adapters read into slots as the engine assigns them.

The wrappers go on after quantization, around the linears' final forms; the slots are preallocated at
`max_loras` adapters of `max_lora_rank` (their memory is said at start), so loading an adapter is a copy
into its slot, and a step never allocates for LoRA.
"""

from __future__ import annotations

import logging

import torch

from tokenmill.lora.adapter import AdapterWeights, read_adapter
from tokenmill.lora.layer import LoRALinear, Segment, StepSegments
from tokenmill.models.config import ModelConfig
from tokenmill.models.parallel import Shard

log = logging.getLogger(__name__)

# Each wrapped linear's adapted parts in its output, as Hugging Face names them, and whether it is
# row-parallel (A cut by columns) rather than column-parallel (B cut by rows).
_FUSED = {
    "qkv_proj": (("q_proj", "k_proj", "v_proj"), False),
    "o_proj": (("o_proj",), True),
    "gate_up_proj": (("gate_proj", "up_proj"), False),
    "down_proj": (("down_proj",), True),
}


def _keep(cfg: ModelConfig, shard: Shard, module: str) -> range:
    """The rows (column-parallel: of the output) or columns (row-parallel: of the input) this rank
    keeps of a whole module's weight."""
    d = cfg.head_dim
    if module in ("q_proj", "o_proj"):
        return range(shard.q_heads.start * d, shard.q_heads.stop * d)
    if module in ("k_proj", "v_proj"):
        return range(shard.kv_heads.start * d, shard.kv_heads.stop * d)
    return range(shard.intermediate.start, shard.intermediate.stop)


class LoRAModel:
    def __init__(
        self,
        model: torch.nn.Module,
        cfg: ModelConfig,
        shard: Shard,
        max_loras: int,
        max_rank: int,
        dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        self.cfg, self.shard, self.max_rank, self.dtype = cfg, shard, max_rank, dtype
        self.step = StepSegments()
        self.slots: list[int | None] = [None] * max_loras  # lora_int_id in each slot
        # (global layer, fused module name) -> its wrapper
        self.linears: dict[tuple[int, str], LoRALinear] = {}
        kernels = getattr(model.ops, "k", None)  # the CPU kernels' build, when the model runs on them
        kernel = getattr(kernels, "lora_delta_", None) if device.type == "cpu" else None
        for local, layer in enumerate(model.layers):
            glob = shard.layers.start + local
            for holder in (layer.self_attn, layer.mlp):
                for name in _FUSED:
                    base = getattr(holder, name, None)
                    if base is None:
                        continue
                    parts = self._parts(name, base.out_features)
                    wrapped = LoRALinear(base, parts, max_loras, max_rank, dtype, device, self.step, kernel)
                    setattr(holder, name, wrapped)
                    self.linears[(glob, name)] = wrapped
        model.lora = self  # type: ignore[assignment]
        model.finalize()  # the layers' bound calls now go through the wrappers
        mb = self.memory_bytes / 2**20
        log.info("LoRA: %d slots of rank %d, %d linears, %.1f MB", max_loras, max_rank, len(self.linears), mb)

    def _parts(self, fused: str, out_features: int) -> list[tuple[int, int]]:
        names, row_parallel = _FUSED[fused]
        if row_parallel:
            return [(0, out_features)]
        parts, start = [], 0
        for n in names:
            width = len(_keep(self.cfg, self.shard, n))
            parts.append((start, start + width))
            start += width
        if start != out_features:
            raise ValueError(f"{fused}: parts add up to {start} outputs, the layer has {out_features}")
        return parts

    @property
    def memory_bytes(self) -> int:
        return sum(
            w.a.numel() * w.a.element_size() + sum(b.numel() * b.element_size() for b in w.b)
            for w in self.linears.values()
        )

    def load(self, slot: int, lora_id: int, path: str) -> None:
        """Read the adapter at `path` into `slot` (this rank's share of it)."""
        info, weights = read_adapter(path, self.cfg, self.max_rank)
        scaling = info.scaling
        for (layer, fused), wrapper in self.linears.items():
            wrapper.set_slot(slot, self._deltas(weights, layer, fused, scaling))
        self.slots[slot] = lora_id

    def clear(self, slot: int) -> None:
        for wrapper in self.linears.values():
            wrapper.clear_slot(slot)
        self.slots[slot] = None

    def _deltas(
        self, weights: AdapterWeights, layer: int, fused: str, scaling: float
    ) -> list[tuple[torch.Tensor, torch.Tensor, float] | None]:
        names, row_parallel = _FUSED[fused]
        out: list[tuple[torch.Tensor, torch.Tensor, float] | None] = []
        for n in names:
            ab = weights.get((layer, n))
            if ab is None:
                out.append(None)
                continue
            a, b = ab
            keep = _keep(self.cfg, self.shard, n)
            if row_parallel:
                a = a[:, keep.start : keep.stop]
            else:
                b = b[keep.start : keep.stop]
            out.append((a, b, scaling))  # the slot's copy converts, once, to its own dtype
        return out

    def set_segments(self, segments: list[Segment]) -> None:
        self.step.set(segments)
