"""A LoRA adapter in PEFT's format: adapter_config.json beside adapter_model.safetensors.

Each adapted linear W gets a delta scaling * B A (A: [r, in], B: [out, r]), scaling = lora_alpha / r, or
lora_alpha / sqrt(r) with rsLoRA. `inspect_adapter` checks a directory against the model from the
config and the tensors' headers alone (cheap: what the server does before it accepts a name);
`read_adapter` loads the tensors (what a worker does when it gives the adapter a slot).

Forms PEFT can save that this engine does not compute are refused by name rather than served wrong:
DoRA, LoRA biases, per-module rank or alpha patterns, modules_to_save, embedding or head adapters.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from tokenmill.models.config import ModelConfig

if TYPE_CHECKING:  # the server's API process checks adapters without torch (only workers read them)
    import torch

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
# The linears of a decoder layer an adapter may target (Hugging Face's names), and the part of the layer
# they are in.
TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
_MLP = ("gate_proj", "up_proj", "down_proj")
_KEY = re.compile(r"(?:^|\.)layers\.(\d+)\.(self_attn|mlp)\.(\w+)\.lora_([AB])(?:\.[\w-]+)?\.weight$")


class LoRAError(ValueError):
    """An adapter that cannot be served: the message says why, for the client that asked for it."""


@dataclass(frozen=True)
class AdapterInfo:
    path: str
    rank: int
    scaling: float
    modules: frozenset[str]  # the TARGETS it adapts
    num_layers: int  # layers with at least one adapted linear


# (layer, HF module name) -> (A [r, in], B [out, r]), in the file's dtype.
AdapterWeights = dict[tuple[int, str], tuple["torch.Tensor", "torch.Tensor"]]


def module_shapes(cfg: ModelConfig) -> dict[str, tuple[int, int]]:
    """(out, in) of each target linear in a whole (unsharded) layer."""
    h, inter = cfg.hidden_size, cfg.intermediate_size
    q, kv = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    return {
        "q_proj": (q, h),
        "k_proj": (kv, h),
        "v_proj": (kv, h),
        "o_proj": (h, q),
        "gate_proj": (inter, h),
        "up_proj": (inter, h),
        "down_proj": (h, inter),
    }


def _config(path: Path) -> dict:
    if not path.is_dir():
        raise LoRAError(f"adapter directory {str(path)!r} does not exist")
    f = path / CONFIG_FILE
    if not f.is_file():
        raise LoRAError(f"{str(path)!r} has no {CONFIG_FILE}: not a PEFT adapter directory")
    try:
        cfg = json.loads(f.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise LoRAError(f"{CONFIG_FILE} in {str(path)!r} is not valid JSON: {e}") from None
    if not isinstance(cfg, dict):
        raise LoRAError(f"{CONFIG_FILE} in {str(path)!r} is not a JSON object")
    return cfg


def _scaling(cfg: dict, where: str) -> tuple[int, float]:
    kind = str(cfg.get("peft_type", "LORA")).upper()
    if kind != "LORA":
        raise LoRAError(f"{where}: peft_type {kind!r}; only LORA adapters are served")
    refused = {
        "use_dora": "DoRA adapters",
        "lora_bias": "LoRA biases",
        "rank_pattern": "per-module ranks (rank_pattern)",
        "alpha_pattern": "per-module alphas (alpha_pattern)",
        "modules_to_save": "modules_to_save (whole trained copies of base modules)",
        "fan_in_fan_out": "fan_in_fan_out (GPT-2's Conv1D layout)",
        "layer_replication": "layer_replication",
    }
    for key, what in refused.items():
        if cfg.get(key):
            raise LoRAError(f"{where}: {what} are not supported")
    if cfg.get("bias", "none") != "none":
        raise LoRAError(f"{where}: bias {cfg['bias']!r}; only bias 'none' is supported")
    r, alpha = cfg.get("r"), cfg.get("lora_alpha")
    if not isinstance(r, int) or isinstance(r, bool) or r < 1:
        raise LoRAError(f"{where}: r must be a positive integer, got {r!r}")
    if not isinstance(alpha, int | float) or isinstance(alpha, bool):
        raise LoRAError(f"{where}: lora_alpha must be a number, got {alpha!r}")
    return r, alpha / math.sqrt(r) if cfg.get("use_rslora") else alpha / r


def _targets(cfg: dict, where: str) -> None:
    targets = cfg.get("target_modules")
    if isinstance(targets, list):
        unknown = [t for t in targets if t.rsplit(".", 1)[-1] not in TARGETS]
        if unknown:
            raise LoRAError(
                f"{where}: target modules {unknown} are not linears of this model's layers "
                f"(those are {', '.join(TARGETS)})"
            )


def fingerprint(path: str | Path) -> str:
    """The weights file's size and modification time: another file under the same name and directory
    (an adapter retrained and loaded again) gets another, and with it other KV cache entries."""
    st = (Path(path) / WEIGHTS_FILE).stat()
    return f"{st.st_size}-{st.st_mtime_ns}"


def inspect_adapter(path: str | Path, model: ModelConfig, max_rank: int) -> AdapterInfo:
    """Check an adapter directory against the model without reading its weights; LoRAError says why
    it cannot be served."""
    from safetensors import SafetensorError, safe_open

    p = Path(path)
    cfg = _config(p)
    where = f"adapter {str(p)!r}"
    rank, scaling = _scaling(cfg, where)
    if rank > max_rank:
        raise LoRAError(f"{where}: rank {rank} is above --max-lora-rank {max_rank}")
    _targets(cfg, where)
    f = p / WEIGHTS_FILE
    if not f.is_file():
        other = (
            " (adapter_model.bin, a pickle, is not read: save with safetensors)"
            if (p / "adapter_model.bin").exists()
            else ""
        )
        raise LoRAError(f"{where} has no {WEIGHTS_FILE}{other}")
    shapes = module_shapes(model)
    seen: dict[tuple[int, str], set[str]] = {}
    try:
        # Headers only, with numpy's framework: reading shapes needs no torch.
        with safe_open(str(f), framework="numpy") as st:
            for key in st.keys():  # noqa: SIM118 - safe_open has no __iter__
                m = _KEY.search(key)
                if m is None:
                    raise LoRAError(f"{where}: tensor {key!r} adapts no linear of a decoder layer")
                layer, module, ab = int(m[1]), m[3], m[4]
                if module not in TARGETS:
                    names = ", ".join(TARGETS)
                    raise LoRAError(f"{where}: {module!r} is not a linear this model has ({names})")
                if not 0 <= layer < model.num_layers:
                    raise LoRAError(f"{where}: layer {layer}, but the model has {model.num_layers}")
                if module in _MLP and model.is_moe_layer(layer):
                    raise LoRAError(f"{where}: layer {layer}'s MLP is a mixture of experts (no LoRA there)")
                out, inp = shapes[module]
                want = [rank, inp] if ab == "A" else [out, rank]
                got = list(st.get_slice(key).get_shape())
                if got != want:
                    raise LoRAError(f"{where}: {key} has shape {got}, this model needs {want} (rank {rank})")
                seen.setdefault((layer, module), set()).add(ab)
    except SafetensorError as e:
        raise LoRAError(f"{where}: {WEIGHTS_FILE} is not a readable safetensors file ({e})") from None
    half = [f"layers.{i}.{m}" for (i, m), ab in seen.items() if ab != {"A", "B"}]
    if half:
        raise LoRAError(f"{where}: {half[0]} has lora_A or lora_B but not both")
    if not seen:
        raise LoRAError(f"{where}: no LoRA tensors in {WEIGHTS_FILE}")
    return AdapterInfo(str(p), rank, scaling, frozenset(m for _, m in seen), len({i for i, _ in seen}))


def read_adapter(path: str | Path, model: ModelConfig, max_rank: int) -> tuple[AdapterInfo, AdapterWeights]:
    """The adapter's checked description and its tensors."""
    from safetensors import safe_open

    info = inspect_adapter(path, model, max_rank)
    weights: AdapterWeights = {}
    pairs: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
    with safe_open(str(Path(path) / WEIGHTS_FILE), framework="pt") as st:
        for key in st.keys():  # noqa: SIM118
            m = _KEY.search(key)
            assert m is not None  # inspect_adapter checked every key
            pairs.setdefault((int(m[1]), m[3]), {})[m[4]] = st.get_tensor(key)
    for k, ab in pairs.items():
        weights[k] = (ab["A"], ab["B"])
    return info, weights
