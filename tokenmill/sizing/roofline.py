"""The performance model: a roofline per step, with efficiency factors, communication and overhead.

Per step (../shared/reference/bench_and_sizing.md, sections 3 and 6):

    t = max(FLOPs / (TP * peak * MFU), weight bytes / (TP * BW * MBU_w) + KV bytes / (TP * BW * MBU_kv))
        + 2 all-reduces per layer (TP > 1) + pipeline hops (PP > 1) + layers * overhead per layer

Prefill of S tokens costs 2 * P_active_nonembedding * S + 2 * L * S^2 * heads * head_dim (causal
attention) + the logits of the last token; a decode step of B sequences costs B * (2 * P_active +
4 * L * ctx * heads * head_dim) and reads every weight once plus every sequence's KV cache. A
mixture-of-experts step reads only the experts its tokens were routed to (expected count for a
uniform router). Split by tensor parallelism, each rank reads its share of every touched expert; split
by expert parallelism (`ep`), a rank reads its own touched experts whole, and the step waits for the
rank with the most: the expected maximum over the ranks, which at a few tokens is well above the mean
(one token's two experts on one rank of two). Either way the layer's output is summed by the same
all-reduce (tokenmill's expert parallelism: models/moe.py).

Serving a closed loop of C requests per instance is modelled in "lockstep" (section 6.4), the regime
of a concurrency benchmark with fixed lengths: the C prompts are prefilled together (TTFT), then
decoded together at a context of ISL + OSL/2 (ITL), so an instance completes C / E2E requests per
second. Pipeline parallelism splits the C sequences into PP micro-batches in flight at once.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from tokenmill.sizing.arch import Arch
from tokenmill.sizing.hardware import KV_CACHE_DTYPES, PRECISIONS, Factors, Gpu

ACT_BYTES = 2.0  # activations travel between GPUs in 16 bits
MEMORY_USABLE = 0.9  # share of GPU memory for weights + KV (the rest: activations, workspace)


@dataclass(frozen=True)
class Deployment:
    arch: Arch
    gpu: Gpu
    precision: str
    factors: Factors
    tp: int = 1
    pp: int = 1
    ep: bool = False  # MoE: whole experts spread over the TP group, rather than each expert's columns
    kv_cache_dtype: str = "auto"  # the KV cache's own dtype (KV_CACHE_DTYPES); "auto": the precision's

    @property
    def gpus(self) -> int:
        return self.tp * self.pp

    @property
    def b_w(self) -> float:
        return PRECISIONS[self.precision][0]

    @property
    def b_kv(self) -> float:
        own = KV_CACHE_DTYPES[self.kv_cache_dtype]
        return PRECISIONS[self.precision][1] if own is None else own

    # --- memory ---------------------------------------------------------------------------------

    def weight_gb_per_gpu(self) -> float:
        return self.arch.params_total * self.b_w / self.gpus / 1e9

    def kv_gb_per_gpu(self, seqs: int, ctx: int) -> float:
        return seqs * ctx * self.arch.kv_bytes_per_token(self.b_kv) / self.gpus / 1e9

    def fits(self, seqs: int, ctx: int) -> bool:
        return self.weight_gb_per_gpu() + self.kv_gb_per_gpu(seqs, ctx) <= MEMORY_USABLE * self.gpu.memory_gb

    def max_seqs(self, ctx: int) -> int:
        free = MEMORY_USABLE * self.gpu.memory_gb - self.weight_gb_per_gpu()
        per_seq = self.kv_gb_per_gpu(1, ctx)
        return max(0, int(free / per_seq)) if per_seq > 0 else 0

    # --- one step ---------------------------------------------------------------------------------

    def _comm(self, tokens: int, layers: int) -> float:
        """TP all-reduces (2 per layer, with or without EP: the mixture's output is summed over the ranks
        as a dense MLP's is) and the pipeline's stage-to-stage hops, for `tokens` rows of activations."""
        f, t = self.factors, 0.0
        link = max(self.gpu.link_gbs * f.link_efficiency, 1e-9) * 1e9
        msg = tokens * self.arch.hidden * ACT_BYTES
        if self.tp > 1:
            per = f.allreduce_latency_s + 2 * (self.tp - 1) / self.tp * msg / link
            t += 2 * layers * per
        if self.pp > 1:
            t += (self.pp - 1) * (f.allreduce_latency_s + msg / link)
        return t

    def _weight_bytes(self, tokens: int) -> float:
        a = self.arch
        if not a.is_moe:
            return a.params_total * self.b_w
        hit = 1 - (1 - a.active_experts / a.experts) ** tokens  # the chance an expert is touched
        touched = a.experts * hit
        if self.ep and self.tp > 1:
            # The busiest rank's touched experts, as if each rank read that many (the step waits for it).
            touched = self.tp * expected_max_touched(a.experts // self.tp, hit, self.tp)
        dense = a.params_total - a.layers * a.experts * a.expert_params
        return (dense + a.layers * touched * a.expert_params) * self.b_w

    def _step(self, flops: float, weight_bytes: float, kv_bytes: float, tokens: int) -> float:
        f, g = self.factors, self.gpu
        peak = g.peak_tflops(self.precision) * 1e12
        bw = g.bandwidth_tbs * 1e12
        compute = flops / (self.tp * peak * f.mfu)
        memory = weight_bytes / (self.tp * bw * f.mbu_weights) + kv_bytes / (self.tp * bw * f.mbu_kv)
        return (
            max(compute, memory)
            + self._comm(tokens, self.arch.layers)
            + self.arch.layers * f.overhead_per_layer_s
        )

    def prefill_s(self, seqs: int, prompt_len: int) -> float:
        """Time to prefill `seqs` prompts of `prompt_len` tokens in one pass."""
        a = self.arch
        tokens = seqs * prompt_len
        flops = (
            2 * a.params_active_nonembedding * tokens
            + 2 * a.layers * seqs * prompt_len**2 * a.heads * a.head_dim
            + 2 * a.hidden * a.vocab * seqs
        )
        kv_write = tokens * a.kv_bytes_per_token(self.b_kv)
        return self._step(flops, self._weight_bytes(tokens), kv_write, tokens)

    def decode_step_s(self, seqs: int, ctx: float) -> float:
        """One decode step of `seqs` sequences at a context of `ctx` tokens each (pipelined over PP)."""
        a = self.arch
        micro = max(1, math.ceil(seqs / self.pp))
        flops = micro * (2 * a.params_active + 4 * a.layers * ctx * a.heads * a.head_dim)
        kv = micro * ctx * a.kv_bytes_per_token(self.b_kv)
        # With PP, each of the PP micro-batches visits every stage once per step; stages work in parallel
        # on different micro-batches, so a step costs PP passes of one micro-batch through 1/PP of the model.
        return self._step(flops, self._weight_bytes(micro), kv, micro)


def expected_max_touched(per_rank: int, hit: float, ranks: int) -> float:
    """The expected largest count of touched experts on one of `ranks` ranks of `per_rank` experts each,
    every expert touched with chance `hit` independently: sum over j of P(max >= j), with each rank's
    count binomial."""
    cdf, total, below = [], 0.0, 0.0
    for j in range(per_rank + 1):
        below += math.comb(per_rank, j) * hit**j * (1 - hit) ** (per_rank - j)
        cdf.append(min(below, 1.0))
    for j in range(1, per_rank + 1):
        total += 1 - cdf[j - 1] ** ranks
    return total


@dataclass(frozen=True)
class Prediction:
    concurrency: int
    ttft_s: float
    itl_s: float
    e2e_s: float
    rps: float  # requests/s per instance
    fits: bool


def predict(d: Deployment, concurrency: int, isl: int, osl: int) -> Prediction:
    """Closed loop of `concurrency` requests on one instance, in lockstep (module docstring)."""
    ttft = d.factors.client_s + d.prefill_s(concurrency, isl)
    itl = d.decode_step_s(concurrency, isl + osl / 2)
    e2e = ttft + (osl - 1) * itl
    return Prediction(concurrency, ttft, itl, e2e, concurrency / e2e, d.fits(concurrency, isl + osl))
