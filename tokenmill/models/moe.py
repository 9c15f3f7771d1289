"""A mixture-of-experts feed-forward block: a router picks each token's top-k experts, and each expert
(an MLP of its own) computes the tokens routed to it in one matmul per projection.

The routed (token, expert) pairs are sorted by expert once, so each expert's tokens are one contiguous
run of rows: an expert costs a gather-free slice and three matmuls whatever the batch, not a mask and a
`where` per expert (Hugging Face's loop) or a call per token. The outputs, each scaled by its routing
weight, are summed into their tokens' rows by one `index_add_`, in expert order for every token, as
Hugging Face sums them. Each expert's linears are ordinary parallel linears, so every quantization method
(models/quant) and kernel applies to them as to a dense MLP's; the router is kept out of their reach
(`Router`), since a routing decision flips on a small change of its logits.

Parallel: a rank holds its experts' intermediate columns, or whole experts with expert parallelism
(models/parallel.py). It computes what it holds for every token it was given, and the block's output
is the sum over the ranks (one all-reduce, as a dense MLP's).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from tokenmill.models.config import ModelConfig
from tokenmill.models.ops import TorchOps
from tokenmill.models.parallel import Collectives, Shard
from tokenmill.models.parallel_linear import ColumnParallelLinear, Part, RowParallelLinear


class Router(nn.Module):
    """The router's weight [experts, hidden], in the model's dtype: not an nn.Linear, so that neither a
    quantization method nor the packing of plain linears replaces it."""

    def __init__(self, hidden: int, experts: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(experts, hidden), requires_grad=False)


class Expert(nn.Module):
    """One expert: a gated MLP (gate and up fused, as models/llama.py's MLP) on this rank's columns."""

    def __init__(self, cfg: ModelConfig, shard: Shard) -> None:
        super().__init__()
        full = cfg.expert_intermediate_size
        part = Part(full, shard.expert_intermediate)
        self.gate_up_proj = ColumnParallelLinear(cfg.hidden_size, [part, part])
        self.down_proj = RowParallelLinear(shard.expert_intermediate, 1, full, cfg.hidden_size)

    def compute(self) -> Callable[[torch.Tensor, TorchOps], torch.Tensor]:
        gate_up, down = self.gate_up_proj.forward, self.down_proj.forward
        return lambda x, ops: down(ops.silu_mul(gate_up(x)))


def route(logits: torch.Tensor, k: int, renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Each token's top-k experts by softmax probability, and their weights (float32): those
    probabilities, renormalized over the k where the family does (Mixtral always, Qwen3-MoE when
    norm_topk_prob)."""
    probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
    weights, ids = probs.topk(k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, ids


class FusedMoE(nn.Module):
    def __init__(
        self, cfg: ModelConfig, shard: Shard, comm: Collectives, float32_weights: bool = False
    ) -> None:
        """`float32_weights`: the experts' outputs are scaled by their routing weights in float32, then
        rounded to the model's dtype (Mixtral, as transformers computes it); else the weights are rounded
        first (Qwen3-MoE). The same in a float32 model."""
        super().__init__()
        self.float32_weights = float32_weights
        self.num_experts, self.top_k = cfg.num_experts, cfg.experts_per_token
        self.renormalize = cfg.renormalize_experts
        self.router = Router(cfg.hidden_size, cfg.num_experts)
        # Keyed by global expert index, so that parameter names are the checkpoint's on every rank.
        self.experts = nn.ModuleDict({str(e): Expert(cfg, shard) for e in shard.experts})
        self.local = shard.experts
        self.comm = comm

    def forward(self, x: torch.Tensor, ops: TorchOps) -> torch.Tensor:
        weights, ids = route(F.linear(x, self.router.weight), self.top_k, self.renormalize)
        flat = ids.reshape(-1)
        order = flat.argsort(stable=True)  # (token, slot) pairs grouped by expert, tokens in order
        counts = torch.bincount(flat, minlength=self.num_experts).tolist()
        # This rank's experts are a run of expert indices, so their pairs are a run of `order`.
        lo = sum(counts[: self.local.start])
        hi = lo + sum(counts[self.local.start : self.local.stop])
        out = torch.zeros_like(x)
        if hi > lo:
            pairs = order[lo:hi]
            rows = pairs // self.top_k
            xs = x.index_select(0, rows)
            ys = torch.empty_like(xs)
            start = 0
            for e in self.local:
                n = counts[e]
                if n:
                    ys[start : start + n] = self._expert[e - self.local.start](xs[start : start + n], ops)
                    start += n
            w = weights.reshape(-1)[pairs].unsqueeze(1)
            if self.float32_weights and ys.dtype != torch.float32:
                ys = (ys * w).to(x.dtype)  # bf16 rows times float32 weights: float32, then rounded once
            else:
                ys.mul_(w.to(ys.dtype))
            out.index_add_(0, rows, ys)
        return self._reduce(out)

    def finalize(self) -> None:
        self._expert = [self.experts[str(e)].compute() for e in self.local]
        # Each rank holds a part of every token's sum (columns or experts): summed over the ranks.
        self._reduce = self.comm.all_reduce if self.comm.tp_size > 1 else _identity


def _identity(t: torch.Tensor) -> torch.Tensor:
    return t
