"""The Llama family (Llama 2/3, Mistral, SmolLM2, Qwen2/2.5) in plain PyTorch over a flat token batch.

Q/K/V and gate/up projections are fused into one matmul each: on a CPU at small batch the number of
kernel launches, not FLOPs, dominates the step time.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import logging
from collections.abc import Callable, Iterable, Iterator

import torch
from torch import nn

from tokenmill.models.attention.backend import AttentionBackend, AttentionMetadata
from tokenmill.models.config import ModelConfig
from tokenmill.models.decode_step import DecodeStep, decode_step_for
from tokenmill.models.fp8_linear import quantize_linears_fp8
from tokenmill.models.linear import (
    GroupInt8Linear,
    QuantizedLinear,
    int8_matmuls_available,
    pack_linears,
    quantize_linears,
    quantize_linears_int8,
    quantize_linears_int8_groups,
)
from tokenmill.models.ops import CpuFusedOps, TorchOps, get_ops
from tokenmill.models.parallel import Collectives, NoCollectives, Shard, shard_state_dict
from tokenmill.models.parallel_linear import ColumnParallelLinear, ParallelLinear, Part, RowParallelLinear
from tokenmill.models.rope import RotaryEmbedding
from tokenmill.models.smoothing import Calibration, smooth_model, why_not_smoothable
from tokenmill.models.wide_linear import WideEmbedding, WideLinear, widen_linears
from tokenmill.weights.group_codes import C, GroupCodes, Int8Groups

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
        # The strength its weights were smoothed with for int8 (models/smoothing.py), or None.
        self.smoothed_alpha: float | None = None
        # Whether int4 steps above 2 rows quantize their activations to int8 (int4_activations="int8").
        self.int4_a8 = False
        # Whether int8 took its group form (int8_scales): a scale per group of 32 on both sides.
        self.int8_groups = False
        self._step: DecodeStep | None = None  # decode_step()'s, once _step_built
        self._step_built = False

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
        step = self.decode_step()
        if step is not None and step.takes(residual.shape[0], meta, backend, kv_caches):
            m = step.run(residual, positions, kv_caches, meta, backend)  # the loop below, in C++
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
        # Pure decode steps as one C++ call where every layer's kernels allow (models/decode_step.py), built
        # on first use: by then the model holds its own copies of the checkpoint's norms and biases
        # (own_weights.py, after the build), which the step must hold rather than the mapped file's views.
        self._step, self._step_built = None, False

    def decode_step(self) -> DecodeStep | None:
        """The C++ decode step over the model's weights as they are now (built once, after finalize()), or
        None where its kernels keep the Python loop (models/decode_step.py)."""
        if not self._step_built:
            self._step, self._step_built = decode_step_for(self), True
        return self._step

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


# Up to this many rows per step the int4 kernel beats bf16 here (benchmarks/linear_kernels.py).
QUANT_MAX_ROWS = 4


@contextlib.contextmanager
def _skip_init() -> Iterator[None]:
    # Random initialization is wasted work when real weights follow, and on the meta device it
    # imports torch's reference-op machinery (about a second of start-up).
    names = ["normal_", "uniform_", "kaiming_uniform_", "zeros_", "ones_"]
    saved = {n: getattr(nn.init, n) for n in names}
    try:
        for n in names:
            setattr(nn.init, n, lambda t, *a, **k: t)
        yield
    finally:
        for n, f in saved.items():
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


def shard_codes(model: LlamaForCausalLM, codes: dict[str, C]) -> dict[str, C]:
    """The codes (4-bit or 8-bit groups) of the model's (or its shard's) linears, under local names, each
    parallel linear's part cut by the layer itself; a layer whose cut would split a group of 32 gets none
    (its own weight is quantized instead). The output head's ("lm_head", where given) go to the last
    stage, cut to the rank's vocabulary rows as its weight is."""
    linears = {name: m for name, m in model.named_modules() if isinstance(m, ParallelLinear)}
    layers, vocab = model.shard.layers, model.shard.vocab
    out = {}
    for name, full in codes.items():
        if name == "lm_head":
            if model.shard.last_stage:
                rows = (getattr(full, f.name)[vocab.start : vocab.stop] for f in dataclasses.fields(full))
                out[name] = type(full)(*rows)
            continue
        _, idx, rest = name.split(".", 2)
        if int(idx) not in layers:
            continue
        local = f"layers.{int(idx) - layers.start}.{rest}"
        part = linears[local].load_codes(full) if local in linears else None
        if part is not None:
            out[local] = part
    return out


def _int8_groups_for(
    ops: TorchOps, scales: str, dtype: torch.dtype, codes: Callable[[], dict[str, Int8Groups] | None] | None
) -> tuple[bool, dict[str, Int8Groups] | None]:
    """Whether int8 takes its group form (a scale per group of 32 on both sides) here, and the file's
    own codes for it: where the group panels run (they write bf16), when asked for, or with "auto" when
    `codes()` (read only then) finds a Q8_0 file's; elsewhere the per-channel form, saying why if asked."""
    if scales == "channel":
        return False, None
    if not ops.group_panels_available() or dtype != torch.bfloat16:
        why = "the group panel kernels (AVX512-BF16 without AMX) and a bfloat16 model"
        if scales == "group":
            log.warning("int8_scales group needs %s; quantizing per channel", why)
        return False, None
    given = codes() if codes is not None else None
    return scales == "group" or given is not None, given


def _int4_head_in_groups(
    model: LlamaForCausalLM, dtype: torch.dtype, codes: Callable[[], dict[str, Int8Groups] | None] | None
) -> bool:
    """int4's 8-bit output head in int8's group form where the group panels run: a Q8_0 file's own head
    codes (`codes()`: registry.load_int8_head_codes; the embedded model's), else its weight quantized into
    groups of 32, times the activations as 16-bit codes per group at every row count (G8Panels' wide
    rows: the precision of bf16 activations). It then computes the file's weights as they are, where the
    per-channel form (Q8Panels) quantized their values again (int4's perplexity +0.12% against +0.22%),
    and faster up to 32 rows: on SmolLM2-135M's 49152 x 576 head (AMD Zen 4) 1.5x at 1 row in the model,
    1.6-2.6x at 2-8, 1.0x at 32, 0.9x at 128 (docs/benchmarks.md, twenty-third sitting). With 8-bit activation
    codes it would be 1.5x faster at 32-128 rows, but they cost +0.3% perplexity, more than all the 4-bit
    layers' W4A8 (benchmarks/perplexity.py). Whether it took the form."""
    if not model.shard.last_stage or not model.ops.group_panels_available() or dtype != torch.bfloat16:
        return False
    given = codes() if codes is not None else None
    head = shard_codes(model, given).get("lm_head") if given else None
    group_for = functools.partial(model.ops.group_int8_matmul_for, wide_rows=2**62)
    layer = GroupInt8Linear.of(model.lm_head, group_for, head)
    if layer is None:
        return False
    model.lm_head = layer  # type: ignore[assignment]
    return True


def build_model(
    cfg: ModelConfig,
    state_dict: dict[str, torch.Tensor],
    dtype: torch.dtype,
    device: torch.device,
    max_positions: int,
    ops: str = "auto",
    quantization: str | None = None,
    shard: Shard | None = None,
    comm: Collectives | None = None,
    calibration: Calibration | None = None,
    smoothing_alpha: float = 0.7,
    int4_activations: str = "int8",
    int4_codes: dict[str, GroupCodes] | None = None,
    int8_scales: str = "auto",
    int8_codes: Callable[[], dict[str, Int8Groups] | None] | None = None,
    bf16_weights: bool = False,
) -> LlamaForCausalLM:
    """Create the module (whole, or one rank's shard) without initializing random weights, then assign
    the given ones, cut to the shard. `calibration`: what to smooth the activations on before
    quantizing (models/smoothing.py, migration strength `smoothing_alpha`; the worker gives them for
    int8); None leaves the weights as loaded. `int4_activations`: "int8" quantizes the activations of
    int4 steps above 2 rows where the 4-bit panels run (W4A8); "bf16" keeps them (W4A16); the 8-bit
    output head takes 16-bit codes of them in either case where it can (_int4_head_in_groups). `int4_codes`:
    the whole model's 4-bit codes by layer name (a GGUF file's own: registry.load_int4_codes), which
    int4's 4-bit layers take as they are. `int8_scales`: int8's "channel", "group" or "auto" form
    (config.py); `int8_codes`: reads a Q8_0 file's own codes (registry.load_int8_codes; called only
    where the group form can run), which the group form takes as they are and "auto" chooses it for; for
    int4, its output head's (registry.load_int8_head_codes). `bf16_weights`: a float32 model (`dtype`)
    whose linears keep bf16 weights, widened to float32 by the kernels (models/wide_linear.py; where the
    C++ kernels did not build, they stay float32)."""
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
    int8_groups, file_codes = False, None
    if quantization == "int8":
        int8_groups, file_codes = _int8_groups_for(model.ops, int8_scales, dtype, int8_codes)
    if calibration is not None and not int8_groups:  # smoothing is for the per-channel form
        # Before any weight is quantized or packed: the factors are folded into plain weights.
        reason = why_not_smoothable(model)
        if quantization == "int8" and not int8_matmuls_available(device):
            pass  # int8 keeps bf16 weights here (quantize_linears_int8 says so): nothing to smooth for
        elif reason is not None:
            log.warning("weights not smoothed: %s", reason)
        else:
            smooth_model(model, calibration, smoothing_alpha)
    # A float32 model of bf16 weights (models/wide_linear.py): its linears, and int4's copies for big
    # steps, as bf16 panels computed in float32.
    widen = bf16_weights and isinstance(model.ops, CpuFusedOps)
    kernels = model.ops.k if isinstance(model.ops, CpuFusedOps) else None
    wide_for = functools.partial(WideLinear, kernels=kernels) if widen else None
    if quantization == "int4":
        # The output head stays at 8 bits: it is the embedding (Q8_0 or Q6_K in llama.cpp's Q4 files),
        # and every logit depends on it; but a file that keeps it in 4 bits too gives its own codes
        # (load_group_codes), which the head takes: the file's weights exactly, in half the bytes.
        head_codes = "lm_head" in (int4_codes or {})
        if not head_codes:
            _int4_head_in_groups(model, dtype, int8_codes)
        quantize_linears(
            model,
            QUANT_MAX_ROWS,
            bits_for={"lm_head": 4 if head_codes else 8},
            default_bits=4,
            quant_for=functools.partial(
                model.ops.quantized_matmul_for,
                int8_activations=int4_activations == "int8",
                float32_rows=widen,  # the AVX2 4-bit loops: for a float32 model's rows only
            ),
            small_for=model.ops.small_matmul_for,
            codes=shard_codes(model, int4_codes) if int4_codes else None,
            wide_for=wide_for,
        )
        # Any kernel that quantizes a step's activations (the 4-bit panels above 2 rows, the AVX2 4-bit
        # loops up to 4) changes the keys and values (the worker's weights label).
        kernels4 = [m.small for m in model.modules() if isinstance(m, QuantizedLinear)]
        model.int4_a8 = any(getattr(k, "int8_activations", False) for k in kernels4)
    elif quantization == "int8":
        # Every linear, the output head included: per-channel int8 weights keep each vocabulary row's
        # own scale (measured in benchmarks/perplexity.py).
        ops_ = model.ops
        if int8_groups:
            model.int8_groups = True
            given = shard_codes(model, file_codes) if file_codes else None
            quantize_linears_int8_groups(
                model,
                ops_.group_int8_matmul_for,
                ops_.quantize_rows_u8,
                ops_.scale_rows_,
                ops_.int8_matmul_for,
                given,
            )
        else:
            quantize_linears_int8(model, ops_.quantize_rows_u8, ops_.scale_rows_, ops_.int8_matmul_for)
    elif quantization == "fp8":
        quantize_linears_fp8(
            model, model.ops.e4m3_rows, model.ops.scale_rows_cols, small_for=model.ops.fp8_matmul_for
        )
    elif quantization is not None:
        raise ValueError(f"unknown quantization {quantization!r}; available: int4, int8, fp8")
    if widen:
        widen_linears(model, kernels)  # the output head too: tied, it gets panels of its own
        if shard.first_stage:
            model.embed_tokens = WideEmbedding(model.embed_tokens)  # type: ignore[assignment]
    pack_linears(model, model.ops.small_matmul_for, model.ops.panels_take_every_row())
    model.finalize()
    return model.eval()
