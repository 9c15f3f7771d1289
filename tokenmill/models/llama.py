"""The Llama family (Llama 2/3, Mistral, SmolLM2, Qwen2/2.5) in plain PyTorch over a flat token batch.

Q/K/V and gate/up projections are fused into one matmul each: on a CPU at small batch the number of
kernel launches, not FLOPs, dominates the step time.
"""

from __future__ import annotations

import contextlib
import logging
import threading
from collections.abc import Callable, Iterable, Iterator
from typing import TYPE_CHECKING, Protocol

import torch
from torch import nn

from tokenmill.models.attention.backend import AttentionBackend, AttentionMetadata
from tokenmill.models.config import ModelConfig
from tokenmill.models.ops import TorchOps, get_ops
from tokenmill.models.parallel import Collectives, NoCollectives, Shard, shard_state_dict
from tokenmill.models.parallel_linear import ColumnParallelLinear, ParallelLinear, Part, RowParallelLinear
from tokenmill.models.quant import QuantConfig, QuantMethod, quantize_model
from tokenmill.models.rope import RotaryEmbedding

if TYPE_CHECKING:
    from tokenmill.lora.model import LoRAModel

log = logging.getLogger(__name__)


class RMSNorm(nn.Module):
    """Holds the weight; the computation is an op of the model's `ops` (fused with the residual add)."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, shard: Shard, comm: Collectives, layer: int = 0) -> None:
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
        self.scale = cfg.attention_scale or self.head_dim**-0.5
        self.rope_dim = cfg.rope_dim
        self.window = cfg.window_of(layer)  # layer: its global index
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
        self.rotate_(qkv, positions, rope, ops)
        q = qkv[:, : self.q_size].view(t, self.num_heads, self.head_dim)
        k = qkv[:, self.q_size : self.q_size + self.kv_size].view(t, self.num_kv, self.head_dim)
        v = qkv[:, self.q_size + self.kv_size :].view(t, self.num_kv, self.head_dim)
        o = backend.forward(q, k, v, kv_cache[0], kv_cache[1], meta, self.scale, self.window)
        return self._reduce(self._o(o.reshape(t, self.q_size)))

    def rotate_(
        self, qkv: torch.Tensor, positions: torch.Tensor, rope: RotaryEmbedding, ops: TorchOps
    ) -> None:
        """Rope on the q and k heads together, in place in the projection's output."""
        heads = self.num_heads + self.num_kv
        if self.rope_dim == self.head_dim:
            ops.rope_(qkv, heads, self.head_dim, positions, rope.cos, rope.sin_signed)
            return
        # Partial rotary (Phi-4-mini): the first rope_dim of each head turn, the rest pass through. Plain
        # PyTorch, the semantics of ops.rope_ on a strided view of those dimensions.
        x = qkv[:, : heads * self.head_dim].view(qkv.shape[0], heads, self.head_dim)[..., : self.rope_dim]
        c = rope.cos[positions].unsqueeze(1).to(x.dtype)
        s = rope.sin_signed[positions].unsqueeze(1).to(x.dtype)
        x.copy_(x * c + x.roll(self.rope_dim // 2, dims=-1) * s)

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
    def __init__(self, cfg: ModelConfig, attn: nn.Module, mlp: nn.Module) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = attn
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = mlp


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

    Other families are this decoder with their own attention or MLP (`attention_cls`, `make_mlp`): each
    in a file of its own (models/qwen3.py, gemma3.py, mixtures.py), listed in models/registry.py.
    """

    attention_cls: type[Attention] = Attention

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
        self.layers = nn.ModuleList(self.make_layer(cfg, i, shard) for i in shard.layers)
        for layer in self.layers:
            if layer.self_attn.window >= rope.cos.shape[0]:
                layer.self_attn.window = 0  # no context this long: a window that never binds
        if shard.last_stage:
            self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
            self.lm_head = nn.Linear(cfg.hidden_size, len(shard.vocab), bias=False)
        self.rope = rope
        self.ops: TorchOps = TorchOps()
        # The quantization method its linears took (models/quant), once built.
        self.quant: QuantMethod | None = None
        # What runs the layers of the steps it takes instead of the Python loop, if the runner set one.
        self.layer_loop: LayerLoop | None = None
        # Its LoRA slots (tokenmill/lora/model.py), when adapters are served.
        self.lora: LoRAModel | None = None

    def make_layer(self, cfg: ModelConfig, layer: int, shard: Shard) -> DecoderLayer:
        """Layer `layer` (global index)."""
        attn = self.attention_cls(cfg, shard, self.comm, layer)
        return DecoderLayer(cfg, attn, self.make_mlp(cfg, layer, shard))

    def make_mlp(self, cfg: ModelConfig, layer: int, shard: Shard) -> nn.Module:
        """Layer `layer`'s (global index) feed-forward block."""
        return MLP(cfg, shard, self.comm)

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
        pool_indices: torch.Tensor | None = None,  # [P]: rows whose final hidden states are wanted
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """[S, vocab] logits in the model's dtype on the last stage, and with `pool_indices` also the
        [P, hidden] final-norm hidden states of those rows (what embeddings pool); on other stages the
        [T, hidden] activations for the next."""
        ops, eps = self.ops, self.config.rms_norm_eps
        residual = self._embed(inputs) if self.shard.first_stage else inputs
        residual = self.run_layers(residual, positions, kv_caches, meta, backend)
        if not self.shard.last_stage:
            return residual
        logits = self.logits(residual[logits_indices])
        if pool_indices is None:
            return logits
        return logits, ops.rms_norm(residual[pool_indices], self.norm.weight, eps)

    def logits(self, rows: torch.Tensor) -> torch.Tensor:
        """Next-token logits of residual-stream rows: the final norm, the head, the softcap."""
        return self.head(self.ops.rms_norm(rows, self.norm.weight, self.config.rms_norm_eps))

    def head(self, h: torch.Tensor) -> torch.Tensor:
        """Next-token logits of final-norm hidden states (a collective under tensor parallelism: every
        rank of the last stage calls it with the same rows)."""
        # In the model's dtype, as the head computed them: the sampler widens to float32 only what it edits
        # (penalties, masks, draft rows). A float32 copy here cost a step ~50 MB of fresh pages at 256
        # rows, the most page faults of an offline run (perf), for no precision the head had not already
        # rounded away.
        logits = self._lm_head(h)
        if self.comm.tp_size > 1:  # the head is vocabulary-parallel
            logits = self.comm.all_gather_last_dim(logits, self.shard.vocab_sizes(self.config))
        cap = self.config.final_logit_softcap
        if cap:
            logits = torch.tanh(logits / cap) * cap
        return logits

    def run_layers(
        self,
        residual: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: torch.Tensor,
        meta: AttentionMetadata,
        backend: AttentionBackend,
    ) -> torch.Tensor:
        """This stage's layers on the residual stream (in place), which it returns."""
        ops, eps, rope, plan = self.ops, self.config.rms_norm_eps, self.rope, self._plan
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
        return residual.add_(m)

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


# Hugging Face projections this module holds fused: each goes to (fused name, its place, of how many).
_FUSED = {
    "q_proj": ("qkv_proj", 0, 3),
    "k_proj": ("qkv_proj", 1, 3),
    "v_proj": ("qkv_proj", 2, 3),
    "gate_proj": ("gate_up_proj", 0, 2),
    "up_proj": ("gate_up_proj", 1, 2),
}


def to_fused_state_dict(
    hf_tensors: Iterable[tuple[str, torch.Tensor]],
    cfg: ModelConfig,
    rename: Callable[[str], str] | None = None,
    adjust: Callable[[str, torch.Tensor], torch.Tensor] | None = None,
) -> dict[str, torch.Tensor]:
    """Map Hugging Face parameter names/tensors to this module's (fusing q/k/v and gate/up wherever they
    are: an MLP's or an expert's). `rename` first maps a family's own names to Llama's (models/mixtures.py);
    a checkpoint that holds them fused already (Phi-3) passes through. `adjust(name, tensor)` changes a
    family's tensors into the values the module holds (models/gemma3.py's norms)."""
    parts: dict[str, list[torch.Tensor | None]] = {}
    out: dict[str, torch.Tensor] = {}
    for name, t in hf_tensors:
        name = name.removeprefix("model.")
        name = rename(name) if rename is not None else name
        if name.startswith("lm_head.") and cfg.tie_word_embeddings:
            continue
        if "rotary_emb" in name:
            continue
        if adjust is not None:
            t = adjust(name, t)
        owner, _, param = name.rpartition(".")
        parent, _, leaf = owner.rpartition(".")
        if leaf in _FUSED:
            fused, i, n = _FUSED[leaf]
            parts.setdefault(f"{parent}.{fused}.{param}", [None] * n)[i] = t
        else:
            out[name] = t
    for key, ps in parts.items():
        parent, fused, param = key.rsplit(".", 2)
        if any(p is None for p in ps):
            leaves = sorted((i, leaf) for leaf, (f, i, _) in _FUSED.items() if f == fused)
            absent = next(leaf for (_, leaf), p in zip(leaves, ps, strict=True) if p is None)
            raise ValueError(f"missing tensor: {parent}.{absent}.{param}")
        out[key] = torch.cat(ps, dim=0)  # type: ignore[arg-type]
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
        try:
            out[key] = layer.load(param, t) if layer is not None else t
        except ValueError as e:  # a shape that disagrees with the config: say which tensor
            raise ValueError(f"{checkpoint_name(key, model.shard)}: {e}") from None
    return out


def checkpoint_name(key: str, shard: Shard) -> str:
    """A stage's parameter name as the checkpoint has it (its layers are numbered from 0 on each stage)."""
    if key.startswith("layers."):
        _, i, rest = key.split(".", 2)
        return f"layers.{int(i) + shard.layers.start}.{rest}"
    return key


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
    model_cls: type[LlamaForCausalLM] | None = None,
) -> LlamaForCausalLM:
    """Create the module (whole, or one rank's shard) without initializing random weights, assign the
    given ones, cut to the shard, choose its ops (`ops`: "auto", "torch" or a kernel level; models/ops.py)
    and give its linears their quantization method (models/quant: `quant`, None for the checkpoint's own
    weights in `dtype`). `model_cls`: the family's module (models/registry.py), Llama's by default."""
    rope = RotaryEmbedding(
        cfg.rope_dim, max_positions, cfg.rope_theta, cfg.rope_scaling, cfg.extra.get("rope_freq_factors")
    ).to(device)
    shard = shard or Shard.whole(cfg)
    with _skip_init(), torch.device("meta"):
        model = (model_cls or LlamaForCausalLM)(cfg, rope, shard, comm)
    sd = {k: v.to(device=device, dtype=dtype) for k, v in shard_weights(model, state_dict).items()}
    expected = model.state_dict()
    for key, t in sd.items():
        if key in expected and expected[key].shape != t.shape:
            want = tuple(expected[key].shape)
            raise ValueError(
                f"{checkpoint_name(key, shard)}: shape {tuple(t.shape)}, but the config makes it {want}"
            )
    missing, unexpected = model.load_state_dict(sd, strict=False, assign=True)
    tied = cfg.tie_word_embeddings and shard.first_stage
    missing = [m for m in missing if not (m == "lm_head.weight" and tied)]
    if missing:
        more = f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""
        raise ValueError(f"missing tensor: {checkpoint_name(missing[0], shard)}{more}")
    if unexpected:
        more = f" (and {len(unexpected) - 1} more)" if len(unexpected) > 1 else ""
        name = checkpoint_name(unexpected[0], shard)
        raise ValueError(f"unexpected tensor: {name}{more} (not in a {cfg.architecture} model)")
    model.tie_weights()
    model.ops = get_ops(ops, device.type)
    model.quant = quantize_model(model, dtype, quant or QuantConfig())
    model.finalize()
    return model.eval()
