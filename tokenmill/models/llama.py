"""The Llama family (Llama 2/3, Mistral, SmolLM2, Qwen2/2.5) in plain PyTorch over a flat token batch.

Q/K/V and gate/up projections are fused into one matmul each: on a CPU at small batch the number of
kernel launches, not FLOPs, dominates the step time.
"""

from __future__ import annotations

import contextlib
import logging
import threading
from collections.abc import Callable, Iterable, Iterator
from typing import Protocol

import torch
from torch import nn

from tokenmill.models.attention.backend import AttentionBackend, AttentionMetadata
from tokenmill.models.config import ModelConfig
from tokenmill.models.ops import TorchOps, get_ops
from tokenmill.models.parallel import Collectives, NoCollectives, Shard, shard_state_dict
from tokenmill.models.parallel_linear import ColumnParallelLinear, ParallelLinear, Part, RowParallelLinear
from tokenmill.models.quant import QuantConfig, QuantMethod, quantize_model
from tokenmill.models.rope import RotaryEmbedding

log = logging.getLogger(__name__)


class RMSNorm(nn.Module):
    """Holds the weight; the computation is an op of the model's `ops` (fused with the residual add)."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, shard: Shard, comm: Collectives) -> None:
        super().__init__()
        # This rank's heads: all of them, or its tensor-parallel share (models/parallel.py).
        self.num_heads, self.num_kv, self.head_dim = len(shard.q_heads), len(shard.kv_heads), cfg.head_dim
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv * self.head_dim
        d, q_full, kv_full = cfg.head_dim, cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
        kv = Part(kv_full, shard.kv_heads, d)
        self.qkv_proj = ColumnParallelLinear(
            cfg.hidden_size, [Part(q_full, shard.q_heads, d), kv, kv], bias=cfg.attention_bias
        )
        self.o_proj = RowParallelLinear(shard.q_heads, d, q_full, cfg.hidden_size)
        self.scale = self.head_dim**-0.5
        self.comm = comm

    def forward(
        self,
        x: torch.Tensor,
        positions: torch.Tensor,
        rope: RotaryEmbedding,
        ops: TorchOps,
        kv_cache: torch.Tensor,
        meta: AttentionMetadata,
        backend: AttentionBackend,
    ) -> torch.Tensor:
        t = x.shape[0]
        qkv = self._qkv(x)
        # Rope on the q and k heads together, in place in the projection's output.
        ops.rope_(qkv, self.num_heads + self.num_kv, self.head_dim, positions, rope.cos, rope.sin_signed)
        q = qkv[:, : self.q_size].view(t, self.num_heads, self.head_dim)
        k = qkv[:, self.q_size : self.q_size + self.kv_size].view(t, self.num_kv, self.head_dim)
        v = qkv[:, self.q_size + self.kv_size :].view(t, self.num_kv, self.head_dim)
        o = backend.forward(q, k, v, kv_cache[0], kv_cache[1], meta, self.scale)
        return self._reduce(self._o(o.reshape(t, self.q_size)))

    def finalize(self) -> None:
        # Bound methods in the instance dict skip nn.Module's __getattr__ and __call__ machinery,
        # which costs more than the kernels themselves at batch 1 on a CPU.
        self._qkv, self._o = self.qkv_proj.forward, self.o_proj.forward
        # o_proj is row-parallel: each rank's output is a partial sum.
        self._reduce = self.comm.all_reduce if self.comm.tp_size > 1 else _identity


def _identity(t: torch.Tensor) -> torch.Tensor:
    return t


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig, shard: Shard, comm: Collectives) -> None:
        super().__init__()
        full = cfg.intermediate_size
        part = Part(full, shard.intermediate)
        self.gate_up_proj = ColumnParallelLinear(cfg.hidden_size, [part, part])  # gate rows, then up rows
        self.down_proj = RowParallelLinear(shard.intermediate, 1, full, cfg.hidden_size)
        self.comm = comm

    def forward(self, x: torch.Tensor, ops: TorchOps) -> torch.Tensor:
        return self._reduce(self._down(ops.silu_mul(self._gate_up(x))))

    def finalize(self) -> None:
        self._gate_up, self._down = self.gate_up_proj.forward, self.down_proj.forward
        self._reduce = self.comm.all_reduce if self.comm.tp_size > 1 else _identity  # down is row-parallel


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, shard: Shard, comm: Collectives) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg, shard, comm)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(cfg, shard, comm)


class LayerLoop(Protocol):
    """Something that runs every decoder layer of the steps it takes, in place of the Python loop, with
    the same bits: the runner's choice (models/decode_step.py's C++ step, set by worker/model_runner.py)."""

    def takes(
        self, rows: int, meta: AttentionMetadata, backend: AttentionBackend, kv: torch.Tensor
    ) -> bool: ...

    def run(
        self,
        residual: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: torch.Tensor,
        meta: AttentionMetadata,
        backend: AttentionBackend,
    ) -> torch.Tensor: ...


class LlamaForCausalLM(nn.Module):
    """Parameter names follow Hugging Face's, except the fused `qkv_proj` and `gate_up_proj`.

    Built whole, or as one rank's shard (models/parallel.py): a pipeline stage holds its layers (named
    from 0), the embedding only on the first stage, the final norm and head only on the last; a
    tensor-parallel rank holds its heads, MLP columns and vocabulary rows.
    """

    def __init__(
        self,
        cfg: ModelConfig,
        rope: RotaryEmbedding,
        shard: Shard | None = None,
        comm: Collectives | None = None,
    ) -> None:
        super().__init__()
        self.config = cfg
        self.shard = shard = shard or Shard.whole(cfg)
        self.comm: Collectives = comm or NoCollectives()
        if shard.first_stage:
            self.embed_tokens = nn.Embedding(len(shard.vocab), cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg, shard, self.comm) for _ in shard.layers)
        if shard.last_stage:
            self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
            self.lm_head = nn.Linear(cfg.hidden_size, len(shard.vocab), bias=False)
        self.rope = rope
        self.ops: TorchOps = TorchOps()
        # The quantization method its linears took (models/quant), once built.
        self.quant: QuantMethod | None = None
        # What runs the layers of the steps it takes instead of the Python loop, if the runner set one.
        self.layer_loop: LayerLoop | None = None

    @property
    def num_local_layers(self) -> int:
        return len(self.layers)

    @property
    def num_local_kv_heads(self) -> int:
        return len(self.shard.kv_heads)

    @torch.inference_mode()
    def forward(
        self,
        inputs: torch.Tensor,  # [T] token ids on the first stage; [T, hidden] activations on later ones
        positions: torch.Tensor,  # [T]
        kv_caches: torch.Tensor,  # [L, 2, num_blocks, block_size, Hkv, D] (this stage's layers, heads)
        meta: AttentionMetadata,
        backend: AttentionBackend,
        logits_indices: torch.Tensor,  # [S]: rows whose next-token logits are wanted
    ) -> torch.Tensor:  # [S, vocab] in the model's dtype on the last stage; else [T, hidden] activations
        ops, eps, rope = self.ops, self.config.rms_norm_eps, self.rope
        plan = self._plan
        residual = self._embed(inputs) if self.shard.first_stage else inputs
        loop = self.layer_loop
        if loop is not None and loop.takes(residual.shape[0], meta, backend, kv_caches):
            m = loop.run(residual, positions, kv_caches, meta, backend)  # the loop below, in C++
        else:
            x = ops.rms_norm(residual, plan[0][2], eps)
            for i, (attn, mlp, _, post_norm_w, next_norm_w) in enumerate(plan):
                a = attn(x, positions, rope, ops, kv_caches[i], meta, backend)
                # Each residual add is fused with the norm that follows it (the next layer's, or the final).
                x = ops.add_rms_norm(a, residual, post_norm_w, eps)
                m = mlp(x, ops)
                if next_norm_w is not None:
                    x = ops.add_rms_norm(m, residual, next_norm_w, eps)
        residual.add_(m)
        if not self.shard.last_stage:
            return residual
        h = ops.rms_norm(residual[logits_indices], self.norm.weight, eps)
        # In the model's dtype, as the head computed them: the sampler widens to float32 only what it edits
        # (penalties, masks, draft rows). A float32 copy here cost a step ~50 MB of fresh pages at 256
        # rows, the most page faults of an offline run (perf), for no precision the head had not already
        # rounded away.
        logits = self._lm_head(h)
        if self.comm.tp_size > 1:  # the head is vocabulary-parallel
            logits = self.comm.all_gather_last_dim(logits, self.shard.vocab_sizes(self.config))
        return logits

    def _embed(self, ids: torch.Tensor) -> torch.Tensor:
        if self.comm.tp_size == 1:
            return self.embed_tokens(ids)
        # Vocabulary-parallel: each rank looks up the ids in its rows, zeros elsewhere, and the sum
        # over ranks is the embedding (exact: every element is one row's value plus zeros).
        v = self.shard.vocab
        mine = (ids >= v.start) & (ids < v.stop)
        out = self.embed_tokens(torch.where(mine, ids - v.start, 0))
        out.masked_fill_(~mine.unsqueeze(-1), 0)
        return self.comm.all_reduce(out)

    def finalize(self) -> None:
        """Resolve the per-layer calls once (after weights are packed or quantized)."""
        layers = list(self.layers)
        self._plan = []
        for i, layer in enumerate(layers):
            layer.self_attn.finalize()
            layer.mlp.finalize()
            nxt = layers[i + 1].input_layernorm.weight if i + 1 < len(layers) else None
            self._plan.append(
                (
                    layer.self_attn.forward,
                    layer.mlp.forward,
                    layer.input_layernorm.weight,
                    layer.post_attention_layernorm.weight,
                    nxt,
                )
            )
        if self.shard.last_stage:
            self._lm_head = self.lm_head.forward
        self.layer_loop = None  # it held the weights as they were

    def tie_weights(self) -> None:
        if self.config.tie_word_embeddings and self.shard.first_stage and self.shard.last_stage:
            self.lm_head.weight = self.embed_tokens.weight


def to_fused_state_dict(
    hf_tensors: Iterable[tuple[str, torch.Tensor]], cfg: ModelConfig
) -> dict[str, torch.Tensor]:
    """Map Hugging Face parameter names/tensors to this module's (fusing q/k/v and gate/up)."""
    pending: dict[str, torch.Tensor] = {}
    out: dict[str, torch.Tensor] = {}
    for name, t in hf_tensors:
        name = name.removeprefix("model.")
        if name.startswith("lm_head.") and cfg.tie_word_embeddings:
            continue
        if any(p in name for p in ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj")):
            pending[name] = t
            continue
        if "rotary_emb" in name:
            continue
        out[name] = t
    for i in range(cfg.num_layers):
        pre = f"layers.{i}."
        for kind in ("weight", "bias"):
            parts = [pending.pop(f"{pre}self_attn.{p}_proj.{kind}", None) for p in "qkv"]
            if all(p is not None for p in parts):
                out[f"{pre}self_attn.qkv_proj.{kind}"] = torch.cat(parts, dim=0)
            elif any(p is not None for p in parts):
                raise ValueError(f"layer {i}: q/k/v {kind} tensors are incomplete")
        gate = pending.pop(f"{pre}mlp.gate_proj.weight", None)
        up = pending.pop(f"{pre}mlp.up_proj.weight", None)
        if gate is None or up is None:
            raise ValueError(f"layer {i}: missing mlp gate/up weights")
        out[f"{pre}mlp.gate_up_proj.weight"] = torch.cat([gate, up], dim=0)
    if pending:
        raise ValueError(f"unexpected tensors: {sorted(pending)[:5]}")
    return out


# nn.init's functions while any build holds them replaced (_skip_init), and how many builds do.
_INIT_NAMES = ("normal_", "uniform_", "kaiming_uniform_", "zeros_", "ones_")
_init_saved: dict[str, Callable[..., torch.Tensor]] = {}
_init_holders = 0
_init_lock = threading.Lock()


@contextlib.contextmanager
def _skip_init() -> Iterator[None]:
    # Random initialization is wasted work when real weights follow, and on the meta device it
    # imports torch's reference-op machinery (about a second of start-up). Counted under a lock: ranks
    # built in threads at once (tests' thread collectives) would otherwise save one another's no-ops as
    # the originals, and leave nn.init without random initialization for the rest of the process.
    global _init_holders
    with _init_lock:
        if _init_holders == 0:
            _init_saved.update({n: getattr(nn.init, n) for n in _INIT_NAMES})
            for n in _INIT_NAMES:
                setattr(nn.init, n, lambda t, *a, **k: t)
        _init_holders += 1
    try:
        yield
    finally:
        with _init_lock:
            _init_holders -= 1
            if _init_holders == 0:
                for n, f in _init_saved.items():
                    setattr(nn.init, n, f)


def shard_weights(model: LlamaForCausalLM, state_dict: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The model's (or its shard's) tensors from a full state dict: the stage's layers under local
    names and its vocabulary rows (models/parallel.py), each parallel linear's part cut by the layer
    itself."""
    sd = shard_state_dict(state_dict, model.config, model.shard)
    linears = {name: m for name, m in model.named_modules() if isinstance(m, ParallelLinear)}
    out = {}
    for key, t in sd.items():
        owner, _, param = key.rpartition(".")
        layer = linears.get(owner)
        out[key] = layer.load(param, t) if layer is not None else t
    return out


def build_model(
    cfg: ModelConfig,
    state_dict: dict[str, torch.Tensor],
    dtype: torch.dtype,
    device: torch.device,
    max_positions: int,
    ops: str = "auto",
    quant: QuantConfig | None = None,
    shard: Shard | None = None,
    comm: Collectives | None = None,
) -> LlamaForCausalLM:
    """Create the module (whole, or one rank's shard) without initializing random weights, assign the
    given ones, cut to the shard, choose its ops (`ops`: "auto", "torch" or a kernel level; models/ops.py)
    and give its linears their quantization method (models/quant: `quant`, None for the checkpoint's own
    weights in `dtype`)."""
    rope = RotaryEmbedding(
        cfg.head_dim, max_positions, cfg.rope_theta, cfg.rope_scaling, cfg.extra.get("rope_freq_factors")
    ).to(device)
    shard = shard or Shard.whole(cfg)
    with _skip_init(), torch.device("meta"):
        model = LlamaForCausalLM(cfg, rope, shard, comm)
    sd = {k: v.to(device=device, dtype=dtype) for k, v in shard_weights(model, state_dict).items()}
    missing, unexpected = model.load_state_dict(sd, strict=False, assign=True)
    tied = cfg.tie_word_embeddings and shard.first_stage
    missing = [m for m in missing if not (m == "lm_head.weight" and tied)]
    if missing or unexpected:
        raise ValueError(
            f"weights do not match the architecture: missing {missing[:5]}, unexpected {unexpected[:5]}"
        )
    model.tie_weights()
    model.ops = get_ops(ops, device.type)
    model.quant = quantize_model(model, dtype, quant or QuantConfig())
    model.finalize()
    return model.eval()
