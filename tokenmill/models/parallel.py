"""How a model is cut for tensor and pipeline parallelism, and the cutting of its weights at load time.

Tensor parallelism splits attention by key/value-head groups (each rank keeps whole groups, so its
query heads only read its own key/value heads; with more ranks than key/value heads, each head is
replicated and its group's query heads are split), the MLP by intermediate columns, and the embedding
and output head by vocabulary rows. Column-parallel layers (qkv, gate_up, lm_head) keep the rows
of their outputs; row-parallel layers (o_proj, down) keep the matching input columns, and their
outputs are summed over the ranks. Splits need not be even: SmolLM2-135M has 9 query and 3 key/value
heads, so two ranks hold 2 and 1 groups. Pipeline parallelism gives each stage a run of layers; the
first holds the embedding, the last the final norm and the head.

A mixture of experts is cut one of two ways over the same tensor-parallel ranks: each expert's
intermediate columns, as an MLP's (the default), or, with expert parallelism, whole experts, a run of them
per rank. Either way every rank sees every token (attention leaves its output on all of them), computes
its part of each token's chosen experts, and the layer's output is the sum over the ranks: one all-reduce,
as a dense MLP's.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch

from tokenmill.models.config import ModelConfig


def split_range(n: int, parts: int, i: int) -> range:
    """Part i of `parts` near-equal consecutive parts of range(n)."""
    if n < parts:
        raise ValueError(f"cannot split {n} into {parts} non-empty parts")
    return range(i * n // parts, (i + 1) * n // parts)


@dataclass(frozen=True)
class Shard:
    """What one rank holds of a model."""

    q_heads: range
    kv_heads: range
    intermediate: range
    vocab: range
    layers: range  # global indices of this stage's layers
    first_stage: bool
    last_stage: bool
    tp_size: int = 1
    experts: range = range(0)  # the experts this rank holds (global indices)
    expert_intermediate: range = range(0)  # and the columns of each it holds

    @classmethod
    def whole(cls, cfg: ModelConfig) -> Shard:
        return cls.of(cfg, 1, 0, 1, 0)

    @classmethod
    def of(
        cls,
        cfg: ModelConfig,
        tp_size: int,
        tp_rank: int,
        pp_size: int,
        pp_rank: int,
        expert_parallel: bool = False,
    ) -> Shard:
        q_per_kv = cfg.num_heads // cfg.num_kv_heads
        if tp_size <= cfg.num_kv_heads:
            kv = split_range(cfg.num_kv_heads, tp_size, tp_rank)
            q = range(kv.start * q_per_kv, kv.stop * q_per_kv)
        else:
            if tp_size % cfg.num_kv_heads:
                raise ValueError(
                    f"tensor_parallel_size {tp_size} exceeds the {cfg.num_kv_heads} key/value heads and is "
                    "not a multiple of them"
                )
            ranks_per_kv = tp_size // cfg.num_kv_heads
            if ranks_per_kv > q_per_kv:
                raise ValueError(f"tensor_parallel_size {tp_size} exceeds the {cfg.num_heads} query heads")
            head = tp_rank // ranks_per_kv
            sub = split_range(q_per_kv, ranks_per_kv, tp_rank % ranks_per_kv)
            q = range(head * q_per_kv + sub.start, head * q_per_kv + sub.stop)
            kv = range(head, head + 1)
        if pp_size > cfg.num_layers:
            raise ValueError(f"pipeline_parallel_size {pp_size} exceeds the {cfg.num_layers} layers")
        experts, expert_cols = range(cfg.num_experts), range(cfg.expert_intermediate_size)
        if expert_parallel and cfg.num_experts:
            if tp_size > cfg.num_experts:
                raise ValueError(f"expert parallelism over {tp_size} ranks: only {cfg.num_experts} experts")
            experts = split_range(cfg.num_experts, tp_size, tp_rank)
        elif cfg.num_experts:
            expert_cols = split_range(cfg.expert_intermediate_size, tp_size, tp_rank)
        return cls(
            q_heads=q,
            kv_heads=kv,
            intermediate=split_range(cfg.intermediate_size, tp_size, tp_rank),
            vocab=split_range(cfg.vocab_size, tp_size, tp_rank),
            layers=split_range(cfg.num_layers, pp_size, pp_rank),
            first_stage=pp_rank == 0,
            last_stage=pp_rank == pp_size - 1,
            tp_size=tp_size,
            experts=experts,
            expert_intermediate=expert_cols,
        )

    def vocab_sizes(self, cfg: ModelConfig) -> list[int]:
        """Every TP rank's vocabulary slice length, in rank order (for gathering logits)."""
        return [len(split_range(cfg.vocab_size, self.tp_size, r)) for r in range(self.tp_size)]


class Collectives(Protocol):
    """The collectives a parallel model needs (the worker's ParallelState provides them): the two of
    tensor parallelism, and what int8's calibration needs across pipeline stages (models/smoothing.py)."""

    tp_size: int

    def all_reduce(self, t: torch.Tensor) -> torch.Tensor: ...

    def all_gather_last_dim(self, t: torch.Tensor, sizes: list[int]) -> torch.Tensor: ...

    def any_rank(self, flag: bool) -> bool:
        """Whether `flag` is true on any rank of the engine (every stage's): a decision all take."""
        ...

    def send_activations(self, t: torch.Tensor) -> None: ...

    def recv_activations(
        self, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device
    ) -> torch.Tensor: ...


class NoCollectives:
    tp_size = 1

    def all_reduce(self, t: torch.Tensor) -> torch.Tensor:
        return t

    def all_gather_last_dim(self, t: torch.Tensor, sizes: list[int]) -> torch.Tensor:
        return t

    def any_rank(self, flag: bool) -> bool:
        return flag

    def send_activations(self, t: torch.Tensor) -> None:
        raise RuntimeError("a whole model has no next stage")

    def recv_activations(
        self, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device
    ) -> torch.Tensor:
        raise RuntimeError("a whole model has no previous stage")


def _rows(t: torch.Tensor, r: range, unit: int = 1) -> torch.Tensor:
    return t[r.start * unit : r.stop * unit]


def shard_state_dict(sd: dict[str, torch.Tensor], cfg: ModelConfig, s: Shard) -> dict[str, torch.Tensor]:
    """This stage's tensors, under local names (layer i of the stage is `layers.i`), with this rank's
    vocabulary rows of the embedding and head. The linear layers' tensors stay whole: each parallel
    layer cuts its own part (models/parallel_linear.py). The whole model's shard returns the same
    tensors (no copies)."""
    tp = s.tp_size > 1
    out: dict[str, torch.Tensor] = {}
    for name, t in sd.items():
        if name.startswith("layers."):
            _, idx, rest = name.split(".", 2)
            i = int(idx)
            if i not in s.layers:
                continue
            if rest.startswith("mlp.experts.") and int(rest.split(".")[2]) not in s.experts:
                continue  # another rank's expert
            out[f"layers.{i - s.layers.start}.{rest}"] = t
        elif name == "embed_tokens.weight":
            if s.first_stage:
                out[name] = _rows(t, s.vocab) if tp else t
            if s.last_stage and cfg.tie_word_embeddings and not s.first_stage:
                out["lm_head.weight"] = _rows(t, s.vocab)  # the tied head, on a stage without the embedding
        elif name == "lm_head.weight":
            if s.last_stage:
                out[name] = _rows(t, s.vocab) if tp else t
        elif name == "norm.weight":
            if s.last_stage:
                out[name] = t
        else:
            raise ValueError(f"unexpected tensor {name!r}")
    return out
