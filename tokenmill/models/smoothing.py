"""SmoothQuant for `--quantization int8`: move the activations' outlier channels into the weights
before both are quantized to 8 bits.

A linear's input has a few channels far larger than the rest (in a Llama, after the norms and in the
MLP's product). One int8 scale per row must cover the largest, so the small channels keep few levels:
that, not the weights, is most of what W8A8 costs in perplexity. Dividing input channel j by s_j and
multiplying the weight's column j by s_j leaves the product unchanged and evens out the activations;
s_j = max|x_j|^alpha / max|W_j|^(1 - alpha) (Xiao et al., SmoothQuant, 2023) splits the range between
the two. The division is folded into whatever makes the input, so a step does no extra work:

    input norm -> q/k/v        post-attention norm -> gate/up        final norm -> output head
    up rows -> down_proj

o_proj is left as it is: its fold would go into the v rows, so the KV cache would hold values scaled per
channel (blocks offloaded, transferred or 8-bit-quantized by another configuration would then mean
something else), and it measured no gain (perplexity +0.83% without it, +0.76% with it).

Each s_j is rounded to a power of two: then both folds are exact in bf16 (only exponents change), the
smoothed bf16 model computes what the original does, and a last-bit difference in the calibration
maxima between two CPUs rarely changes a factor.

The maxima come from the model's own forward over a calibration text that ships with Python: the
docstrings of standard-library modules, read from their source files (so `python -OO`, which drops
docstrings from loaded modules, reads the same text), a different text from the one perplexity is scored
on (tokenmill/quality/perplexity.py).
"""

from __future__ import annotations

import ast
import hashlib
import importlib.util
import json
import logging
import math
import os
import platform
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file
from torch import nn

from tokenmill.kernels.isa import cpu_summary
from tokenmill.models.attention.backend import AttentionMetadata, PrefillSegment
from tokenmill.models.attention.torch_ref import TorchReferenceBackend
from tokenmill.models.parallel import Collectives

log = logging.getLogger(__name__)

# Standard-library modules whose docstrings make the calibration text (English prose with some code).
CALIBRATION_MODULES = (
    "argparse asyncio collections contextlib csv dataclasses datetime decimal email functools heapq http "
    "inspect itertools json logging os pathlib pickle random re shutil socket sqlite3 statistics string "
    "subprocess tempfile textwrap threading typing unittest urllib uuid zipfile abc ast bisect calendar "
    "codecs difflib enum fractions glob gzip hashlib io ipaddress locale math numbers operator pprint "
    "queue secrets selectors shlex signal ssl struct tarfile timeit tokenize traceback types warnings"
)
CALIBRATION_CHUNKS = 8
CALIBRATION_TOKENS = 256  # per chunk: 2048 tokens in all, ~2 s of prefill for a 135M model on 2 cores
FACTOR_RANGE = 16  # factors are kept within 2^-16 .. 2^16 (a channel that never fires gets the bound)
MAXIMA_FORMAT = 1  # bump when what activation_maxima measures changes: older cached maxima are not read


def _module_docstring(name: str) -> str:
    """A module's docstring from its source file, without importing it; "" where the source is absent
    (a trimmed Python) or unreadable."""
    try:
        spec = importlib.util.find_spec(name)
        if spec is None or not spec.origin or not spec.origin.endswith(".py"):
            return ""
        with open(spec.origin, encoding="utf-8") as f:
            return ast.get_docstring(ast.parse(f.read())) or ""
    except (ImportError, OSError, SyntaxError, ValueError):
        return ""


def calibration_text() -> str:
    docs = (_module_docstring(name).strip() for name in CALIBRATION_MODULES.split())
    return "\n\n".join(d for d in docs if d)


def calibration_chunks(encode: Callable[[str], list[int]]) -> list[list[int]]:
    """CALIBRATION_CHUNKS runs of CALIBRATION_TOKENS tokens, spread evenly over the calibration text;
    none if this Python ships too little of it (then nothing is smoothed)."""
    ids = encode(calibration_text())
    size, n = CALIBRATION_TOKENS, CALIBRATION_CHUNKS
    if len(ids) < size:
        log.warning("the calibration text has only %d tokens here; int8 is quantized unsmoothed", len(ids))
        return []
    stride = max(1, (len(ids) - size) // max(1, n - 1))
    starts = sorted({min(i * stride, len(ids) - size) for i in range(n)})
    return [ids[s : s + size] for s in starts]


@torch.inference_mode()
def activation_maxima(model: nn.Module, chunks: list[list[int]]) -> dict[str, torch.Tensor]:
    """max |x_j| over every token of the chunks, per input channel j of each linear (float32), keyed
    "layers.{i}.qkv" / ".gate_up" / ".down" (this stage's layers) and on the last stage "lm_head": from
    the model's own forward (its ops and weights, before quantization), one chunk at a time as a prompt,
    attention by the reference backend over a scratch cache. Every rank of the engine calls it
    together: tensor-parallel ranks meet in their collectives, pipeline stages pass the chunk on."""
    maxima: dict[str, torch.Tensor] = {}

    def record(
        name: str, fn: Callable[[torch.Tensor], torch.Tensor]
    ) -> Callable[[torch.Tensor], torch.Tensor]:
        def recorded(x: torch.Tensor) -> torch.Tensor:
            m = x.detach().abs().amax(0).float()
            maxima[name] = torch.maximum(maxima[name], m) if name in maxima else m
            return fn(x)

        return recorded

    model.finalize()  # the forward's per-layer calls, which are wrapped here and reset by the next finalize
    for i, layer in enumerate(model.layers):
        attn, mlp = layer.self_attn, layer.mlp
        attn._qkv = record(f"layers.{i}.qkv", attn._qkv)
        mlp._gate_up, mlp._down = (
            record(f"layers.{i}.gate_up", mlp._gate_up),
            record(f"layers.{i}.down", mlp._down),
        )
    if model.shard.last_stage:
        # The head's input is all that is needed of it: its logits (a fifth of a small model's FLOPs)
        # are not computed, except under tensor parallelism, where the forward gathers them across ranks.
        head = model._lm_head if model.comm.tp_size > 1 else _identity
        model._lm_head = record("lm_head", head)

    cfg, device = model.config, model.rope.cos.device
    dtype = _dtype(model)
    block = 16
    backend = TorchReferenceBackend()
    positions_max = model.rope.cos.shape[0]  # a model built for fewer positions sees shorter chunks
    blocks = -(-min(max(len(c) for c in chunks), positions_max) // block)
    kv = torch.zeros(len(model.layers), 2, blocks, block, model.num_local_kv_heads, cfg.head_dim, dtype=dtype)
    kv = kv.to(device)
    for ids in chunks:
        ids = ids[:positions_max]
        t = len(ids)
        seg = PrefillSegment(0, t, 0, torch.arange(-(-t // block), device=device), first_block=0)
        meta = AttentionMetadata.of(list(range(t)), [], [], [seg], block, device)
        positions = torch.arange(t, device=device)
        # Pipeline stages calibrate together, as they run a prompt: each later stage takes the
        # previous one's output (the residual stream) for the chunk and hands its own on.
        if model.shard.first_stage:
            inputs = torch.tensor(ids, device=device)
        else:
            inputs = model.comm.recv_activations((t, cfg.hidden_size), dtype, device)
        out = model(inputs, positions, kv, meta, backend, positions)
        if not model.shard.last_stage:
            model.comm.send_activations(out)
    return maxima


@dataclass(frozen=True)
class Calibration:
    """What int8's smoothing calibrates on: the token chunks, made only when the maxima must be measured
    (reading the text parses ~70 source files, 0.6 s), and a folder (weights_cache_root of the
    checkpoint) where the maxima are kept for the next load of the same weights; None keeps nothing."""

    chunks: Callable[[], list[list[int]]]
    cache: Path | None = None

    @classmethod
    def of(cls, chunks: list[list[int]], cache: Path | None = None) -> Calibration:
        return cls(lambda: chunks, cache)

    def maxima(self, model: nn.Module) -> dict[str, torch.Tensor] | None:
        """The model's activation maxima: from the cache when this model was measured before under the
        same conditions (maxima_key), else measured (~1.4 s of prefill for a 135M model on 2 cores) and
        kept. None when there is nothing to calibrate on."""
        path = None if self.cache is None else self.cache / f"int8-maxima-{maxima_key(model)}.safetensors"
        cached = _read_maxima(path, model) if path is not None else None
        # Every rank measures, or none does: the measuring forward meets in collectives (and a rank
        # whose file is missing would wait there for ranks that had theirs).
        if not model.comm.any_rank(cached is None):
            return cached
        chunks = self.chunks()
        if not chunks:
            return None
        maxima = activation_maxima(model, chunks)
        if path is not None:
            path.parent.mkdir(parents=True, exist_ok=True)
            # Whole or absent: the ranks of a tensor-parallel engine load at the same time.
            tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
            save_file({k: v.contiguous() for k, v in maxima.items()}, tmp)
            os.replace(tmp, path)
        return maxima


def maxima_key(model: nn.Module) -> str:
    """Everything besides the weights (the cache folder's key) that the measured maxima depend on: the
    calibration text (this Python's standard library) and how it is cut, this rank's shard, the dtype,
    and the arithmetic (the kernels' build, the CPU's matmul features, PyTorch's version), so that a
    cached load smooths with the same factors a measuring one would."""
    parts = {
        "format": MAXIMA_FORMAT,
        "python": f"{platform.python_implementation()} {platform.python_version()}",
        "text": [CALIBRATION_MODULES, CALIBRATION_CHUNKS, CALIBRATION_TOKENS],
        "positions": min(CALIBRATION_TOKENS, model.rope.cos.shape[0]),
        "shard": repr(model.shard),
        "dtype": str(_dtype(model)),
        "ops": [model.ops.name, getattr(getattr(model.ops, "k", None), "__name__", "")],
        "cpu": cpu_summary(),
        "torch": torch.__version__,
    }
    return hashlib.sha256(json.dumps(parts, sort_keys=True).encode()).hexdigest()[:16]


def _read_maxima(path: Path, model: nn.Module) -> dict[str, torch.Tensor] | None:
    """Cached maxima that fit this model, or None (absent, unreadable, or not this model's)."""
    if not path.exists():
        return None
    try:
        cached = load_file(path)
    except (OSError, SafetensorError) as e:
        log.warning("cached calibration %s unreadable (%s); measuring again", path, e)
        return None
    if not _fits(cached, model):
        log.warning("cached calibration %s does not fit this model; measuring again", path)
        return None
    return cached


def _fits(maxima: dict[str, torch.Tensor], model: nn.Module) -> bool:
    """The cached maxima name every linear smooth() reads, each as wide as its input."""
    want = {"lm_head": model.lm_head.in_features} if model.shard.last_stage else {}
    for i, layer in enumerate(model.layers):
        want |= {
            f"layers.{i}.qkv": layer.self_attn.qkv_proj.in_features,
            f"layers.{i}.gate_up": layer.mlp.gate_up_proj.in_features,
            f"layers.{i}.down": layer.mlp.down_proj.in_features,
        }
    return maxima.keys() == want.keys() and all(maxima[k].shape == (n,) for k, n in want.items())


def _dtype(model: nn.Module) -> torch.dtype:
    # A later pipeline stage has no embedding: its first norm's dtype is the model's.
    return model.layers[0].input_layernorm.weight.dtype


def _identity(x: torch.Tensor) -> torch.Tensor:
    return x


def _max_over_ranks(t: torch.Tensor, comm: Collectives) -> torch.Tensor:
    """The elementwise max of a vector over the tensor-parallel ranks (each rank's own without them)."""
    if comm.tp_size == 1:
        return t
    n = t.numel()
    gathered = comm.all_gather_last_dim(t.reshape(1, n).contiguous(), [n] * comm.tp_size)
    return gathered.view(comm.tp_size, n).amax(0)


def factors(act_max: torch.Tensor, weight_max: torch.Tensor, alpha: float) -> torch.Tensor:
    """Per input channel: max|x|^alpha / max|W|^(1 - alpha), rounded to a power of two (float32)."""
    a = act_max.float().clamp(min=1e-5)
    w = weight_max.float().clamp(min=1e-5)
    s = a.pow(alpha) / w.pow(1 - alpha)
    return torch.exp2(torch.round(torch.log2(s)).clamp(-FACTOR_RANGE, FACTOR_RANGE))


def _scaled(t: torch.Tensor, by: torch.Tensor) -> nn.Parameter:
    # A new tensor, not an in-place edit: loaded weights may share memory with a cached checkpoint.
    return nn.Parameter((t.float() * by).to(t.dtype), requires_grad=False)


def _column_max(w: torch.Tensor) -> torch.Tensor:
    return w.detach().abs().amax(0).float()


def smooth(model: nn.Module, maxima: dict[str, torch.Tensor], alpha: float) -> None:
    """Fold the factors into the model's weights (see the module doc). The bf16 model's outputs are
    unchanged bit for bit (every factor a power of two); only the int8 quantization that follows sees
    the difference.

    Under tensor parallelism the norms are replicated, so the factors of the inputs every rank shares
    (q/k/v, gate/up, the head) come from the maxima over all ranks: the same on each. down_proj's input
    channels are the rank's own, and so are their factors."""
    comm = model.comm

    def shared(act: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        act_max = _max_over_ranks(act, comm)
        return factors(act_max, _max_over_ranks(_column_max(weight), comm), alpha)

    for i, layer in enumerate(model.layers):
        attn, mlp = layer.self_attn, layer.mlp
        qkv = attn.qkv_proj
        gate_up, down = mlp.gate_up_proj, mlp.down_proj

        s = shared(maxima[f"layers.{i}.qkv"], qkv.weight)
        layer.input_layernorm.weight = _scaled(layer.input_layernorm.weight, 1 / s)
        qkv.weight = _scaled(qkv.weight, s[None, :])

        s = shared(maxima[f"layers.{i}.gate_up"], gate_up.weight)
        layer.post_attention_layernorm.weight = _scaled(layer.post_attention_layernorm.weight, 1 / s)
        gate_up.weight = _scaled(gate_up.weight, s[None, :])

        # down_proj's input is silu(gate) * up: dividing the up rows divides it.
        inter = down.in_features
        s = factors(maxima[f"layers.{i}.down"], _column_max(down.weight), alpha)
        row_s = torch.cat([torch.ones(gate_up.out_features - inter, device=s.device), s])
        gate_up.weight = _scaled(gate_up.weight, 1 / row_s[:, None])
        down.weight = _scaled(down.weight, s[None, :])

    if not model.shard.last_stage:
        return
    # The head: a copy of its weight is scaled, so a tied embedding keeps its own values.
    s = shared(maxima["lm_head"], model.lm_head.weight)
    model.norm.weight = _scaled(model.norm.weight, 1 / s)
    model.lm_head.weight = _scaled(model.lm_head.weight, s[None, :])


def why_not_smoothable(model: nn.Module) -> str | None:
    """Why `smooth_model` does not apply to this model, or None when it does."""
    if _dtype(model) not in (torch.bfloat16, torch.float32):
        return f"{_dtype(model)} cannot hold factors up to 2^{FACTOR_RANGE}"
    from tokenmill.models.llama import MLP, DecoderLayer  # here: llama.py imports quant, which imports this

    for layer in model.layers:
        if type(layer) is not DecoderLayer:
            # Gemma's MLP reads its own pre-feed-forward norm, not the post-attention one the factors go to.
            return f"smoothing covers Llama's layer arrangement, not {type(layer).__name__}'s"
        if type(layer.mlp) is not MLP:
            # A norm's factors would reach the router as well as the experts; folding them there is not done.
            return f"smoothing covers dense MLPs, not {type(layer.mlp).__name__}"
    return None


def smooth_model(model: nn.Module, calibration: Calibration, alpha: float) -> float | None:
    """Calibrate (or take the cached maxima) and fold the factors, before the weights are quantized or
    packed (every rank of a parallel engine calls it together, with the same chunks).
    Without calibration text the model is left unsmoothed (calibration_chunks logs why). The strength it
    was smoothed with, or None."""
    reason = why_not_smoothable(model)
    if reason is not None:
        raise ValueError(f"cannot smooth this model: {reason}")
    if not 0 < alpha < 1:
        raise ValueError(f"smoothing alpha must be in (0, 1), got {alpha}")
    maxima = calibration.maxima(model)
    if maxima is None:
        return None
    smooth(model, maxima, alpha)
    spread = [math.log2(float(m.max() / m.clamp(min=1e-5).median())) for m in maxima.values()]
    log.info("smoothed %d linears, activation range max/median up to 2^%.1f", len(maxima), max(spread))
    return alpha
