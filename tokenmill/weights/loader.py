"""Load a checkpoint's config, weights and tokenizer from GGUF or a Hugging Face directory.

What comes out is format-neutral: the config as a Hugging Face config.json dict and the tensors under
Hugging Face names, passed through the model's own `prepare` (models/registry.py: fusing q/k/v, say).
weights/ knows nothing of the model code. Dequantizing a GGUF file takes seconds; the prepared result
(safetensors, plus the tokenizer as tokenizer.json) is cached per file, dtype and layout, so the next
start only memory-maps it.
"""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import numpy as np
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from tokenmill.paths import default_cache_dir
from tokenmill.tokenizer.tokenizer import Tokenizer
from tokenmill.weights.cache_paths import complete_caches, dtype_cache_path, weights_cache_root
from tokenmill.weights.gguf_config import hf_config_from_gguf
from tokenmill.weights.gguf_file import GGUFFile
from tokenmill.weights.group_codes import (
    GROUP,
    C,
    GroupCodes,
    Int8Groups,
    quantize_groups,
    quantize_int8_groups,
)

# The same for the cached codes (load_group_codes, load_int8_groups, load_int8_head); 2: the int8 codes hold
# the head's; 3: the 4-bit codes hold the head's where the file keeps it in a 4-bit type.
CODES_FORMAT = 3

# GGUF tensor names (per block) to Hugging Face names.
_GGUF_BLOCK_NAMES = {
    "attn_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_q.bias": "self_attn.q_proj.bias",
    "attn_k.bias": "self_attn.k_proj.bias",
    "attn_v.bias": "self_attn.v_proj.bias",
    "attn_output.weight": "self_attn.o_proj.weight",
    "attn_q_norm.weight": "self_attn.q_norm.weight",  # Qwen3's per-head norms
    "attn_k_norm.weight": "self_attn.k_norm.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}
_GGUF_TOP_NAMES = {
    "token_embd.weight": "embed_tokens.weight",
    "output_norm.weight": "norm.weight",
    "output.weight": "lm_head.weight",
}


HFTensors = Iterator[tuple[str, torch.Tensor]]


@dataclass(frozen=True)
class Layout:
    """How a model wants its tensors: `prepare` maps (Hugging Face-named tensors, config dict) to the
    model's state dict; `name` keys the cache (a new layout never reads an old one's files)."""

    name: str
    prepare: Callable[[HFTensors, dict[str, Any]], dict[str, torch.Tensor]]


@dataclass
class Checkpoint:
    hf_config: dict[str, Any]  # Hugging Face config.json keys (GGUF metadata translated)
    state_dict: dict[str, torch.Tensor]  # as the layout prepared it, in the requested dtype
    tokenizer: Tokenizer
    source: Path


def load(path: Path, dtype: torch.dtype, cache_dir: Path | None, layout: Layout) -> Checkpoint:
    """Load from a .gguf file (cached) or a Hugging Face directory."""
    if path.is_dir():
        return _load_hf_dir(path, dtype, layout)
    name = str(dtype).removeprefix("torch.")
    cache = dtype_cache_path(path, name, cache_dir or default_cache_dir()) / layout.name
    if (cache / "done").exists():
        return _load_cached(cache, path)
    loaded = _load_gguf(path, dtype, layout)
    _save_cache(cache, loaded)
    return loaded


def read_hf_config(path: Path, cache_dir: Path | None = None) -> dict[str, Any]:
    """A checkpoint's config as Hugging Face config.json keys, without loading its tensors: for a GGUF
    file from its cache when there is one (parsing the file's metadata takes seconds: its vocabulary)."""
    if path.is_dir():
        return json.loads((path / "config.json").read_text())
    for cached in complete_caches(path, cache_dir):
        return json.loads((cached / "config.json").read_text())
    gguf = GGUFFile(path)
    return hf_config_from_gguf(gguf, has_output_tensor="output.weight" in set(gguf.tensor_names()))


def _load_cached(cache: Path, source: Path) -> Checkpoint:
    config = json.loads((cache / "config.json").read_text())
    return Checkpoint(config, load_file(cache / "model.safetensors"), Tokenizer.from_dir(cache), source)


def _save_cache(cache: Path, loaded: Checkpoint) -> None:
    cache.mkdir(parents=True, exist_ok=True)
    save_file({k: v.contiguous() for k, v in loaded.state_dict.items()}, cache / "model.safetensors")
    (cache / "config.json").write_text(json.dumps(loaded.hf_config, indent=1))
    loaded.tokenizer.save(cache)
    (cache / "done").write_text("ok\n")  # written last: a half-written cache is never used


def _unpermute(w: np.ndarray | torch.Tensor, n_head: int) -> np.ndarray | torch.Tensor:
    # llama.cpp's converter reorders Q/K rows for its interleaved rope; undo it for the rotate-half layout.
    rows = w.shape[0]
    return w.reshape(n_head, rows // n_head // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _load_gguf(path: Path, dtype: torch.dtype, layout: Layout) -> Checkpoint:
    gguf = GGUFFile(path)
    names = set(gguf.tensor_names())
    config = hf_config_from_gguf(gguf, has_output_tensor="output.weight" in names)
    permuted = config["model_type"] in ("llama", "mistral")

    def hf_tensors() -> Iterator[tuple[str, torch.Tensor]]:
        for name, arr in gguf.tensors():
            if name == "rope_freqs.weight":
                continue
            if name.startswith("blk."):
                _, idx, rest = name.split(".", 2)
                hf = _GGUF_BLOCK_NAMES.get(rest)
                if hf is None:
                    raise ValueError(f"{path.name}: unexpected tensor {name}")
                if permuted and rest.startswith("attn_q."):
                    arr = _unpermute(arr, config["num_attention_heads"])
                elif permuted and rest.startswith("attn_k."):
                    arr = _unpermute(arr, config["num_key_value_heads"])
                yield f"layers.{idx}.{hf}", torch.from_numpy(np.array(arr)).to(dtype)
            elif name in _GGUF_TOP_NAMES:
                yield _GGUF_TOP_NAMES[name], torch.from_numpy(np.array(arr)).to(dtype)
            else:
                raise ValueError(f"{path.name}: unexpected tensor {name}")

    if "rope_freqs.weight" in names:
        # llama.cpp stores Llama 3's per-frequency rope factors as a tensor; keep them with the config.
        config["rope_freq_factors"] = gguf.tensor("rope_freqs.weight").tolist()
    state_dict = layout.prepare(hf_tensors(), config)
    tokenizer = Tokenizer.from_gguf_metadata(gguf.metadata)
    return Checkpoint(config, state_dict, tokenizer, path)


class CheckpointCodes:
    """The quantized codes a checkpoint holds, each kind read on first ask and kept (the methods of
    models/quant take them as they are): a GGUF file's 4-bit codes (load_group_codes), its Q8_0 codes
    (load_int8_groups), its output head as 8-bit groups (load_int8_head); None for each from a Hugging
    Face directory."""

    def __init__(self, path: Path, layout: Layout, cache_dir: Path | None) -> None:
        self.path, self.layout, self.cache_dir = path, layout, cache_dir
        self._read: dict[str, Any] = {}

    def _once(self, kind: str, read: Callable[[Path, Layout, Path | None], Any]) -> Any:
        if kind not in self._read:
            self._read[kind] = read(self.path, self.layout, self.cache_dir)
        return self._read[kind]

    def int4(self) -> dict[str, GroupCodes] | None:
        return self._once("int4", load_group_codes)

    def int8(self) -> dict[str, Int8Groups] | None:
        return self._once("int8", load_int8_groups)

    def int8_head(self) -> dict[str, Int8Groups] | None:
        return self._once("head8", load_int8_head)


def load_group_codes(path: Path, layout: Layout, cache_dir: Path | None) -> dict[str, GroupCodes] | None:
    """The 4-bit codes of a GGUF file's linear weights (weights/group_codes.py), under the names the
    layout gives the weights without their ".weight" (fused as it fuses them), for an int4 model to
    take as they are; None for a Hugging Face directory or a file without 4-bit linear weights. A
    linear of another type in such a file (the Q6_K ones of a Q4_K_M file, say) is quantized here from
    its float32 values, so that a fused layer's parts all come as codes. Where the file keeps its output
    head (output.weight, or the tied embedding) in a 4-bit type too, as `llama-quantize --pure` writes
    it, its codes come as "lm_head": the head then computes with the file's own 4-bit weights (half the
    bytes of an 8-bit copy of them, and no second rounding); of another type, the head is left to be
    quantized (8 bits). Cached beside the file's dequantized weights: the next start reads them without
    parsing the file."""
    return _cached_codes(
        path, layout, cache_dir, "int4", GroupCodes,
        lambda: _read_codes(path, layout, GGUFFile.group_codes, quantize_groups, head="own"),
    )  # fmt: skip


def load_int8_groups(path: Path, layout: Layout, cache_dir: Path | None) -> dict[str, Int8Groups] | None:
    """The 8-bit codes of a GGUF file's Q8_0 linear weights (weights/group_codes.py's Int8Groups), named
    and fused as load_group_codes names and fuses the 4-bit ones, for int8's group form to take as they
    are; None for a Hugging Face directory or a file without Q8_0 linear weights. The output head's come
    too, as "lm_head": from output.weight, or the embedding's where the head is tied to it (its own
    Q8_0 codes, as llama.cpp multiplies them, rather than its values rounded to bf16 and quantized
    again). A linear of another type in such a file is quantized into groups from its float32 values.
    Cached as the 4-bit codes are (parsing a GGUF's metadata takes seconds; a file without Q8_0 linears
    is remembered as such)."""
    return _cached_codes(
        path, layout, cache_dir, "int8", Int8Groups,
        lambda: _read_codes(path, layout, GGUFFile.int8_groups, quantize_int8_groups, head="any"),
    )  # fmt: skip


def load_int8_head(path: Path, layout: Layout, cache_dir: Path | None) -> dict[str, Int8Groups] | None:
    """A GGUF file's output head (output.weight, or the tied embedding) as 8-bit codes in groups of 32,
    {"lm_head": ...}, for an int4 model's head to compute in int8's group form: a Q8_0 head's own codes
    (those of llama.cpp's Q4_0 and Q4_1 files where the width is not a multiple of 256, the embedded
    model's), another type's quantized into groups from its float32 values (a Q6_K head's, say); None for
    a Hugging Face directory, or a width that is not a multiple of 32. Cached as the other codes are."""

    def read() -> dict[str, Int8Groups] | None:
        g = _head_codes(GGUFFile(path), GGUFFile.int8_groups, quantize_int8_groups)
        return None if g is None else {"lm_head": g}

    return _cached_codes(path, layout, cache_dir, "head8", Int8Groups, read)


def _cached_codes(
    path: Path,
    layout: Layout,
    cache_dir: Path | None,
    kind: str,
    cls: type[C],
    read: Callable[[], dict[str, C] | None],
) -> dict[str, C] | None:
    """`read()`'s codes of a GGUF file, kept in the file's weights cache under `kind` and the layout; None
    for a Hugging Face directory (or where `read` finds none, which is remembered too)."""
    if path.is_dir():
        return None
    cache = weights_cache_root(path, cache_dir) / f"{kind}-codes-{CODES_FORMAT}" / layout.name
    if (cache / "codes-done").exists():
        if (cache / "codes-done").read_text() == "none\n":
            return None
        return _unpack_codes(load_file(cache / "codes.safetensors"), cls)
    codes = read()
    cache.mkdir(parents=True, exist_ok=True)
    # Each file whole or absent: the ranks of a tensor-parallel engine load at the same time.
    mine = f".{os.getpid()}.tmp"
    if codes is not None:
        save_file(_pack_codes(codes), cache / f"codes.safetensors{mine}")
        os.replace(cache / f"codes.safetensors{mine}", cache / "codes.safetensors")
    (cache / f"codes-done{mine}").write_text("codes\n" if codes is not None else "none\n")
    os.replace(cache / f"codes-done{mine}", cache / "codes-done")  # last, as "done" is
    return codes


def _pack_codes(codes: dict[str, C]) -> dict[str, torch.Tensor]:
    return {
        f"{name}.{f.name}": getattr(g, f.name).contiguous()
        for name, g in codes.items()
        for f in dataclasses.fields(g)
    }


def _unpack_codes(tensors: dict[str, torch.Tensor], cls: type[C]) -> dict[str, C]:
    fields = [f.name for f in dataclasses.fields(cls)]
    names = [key.removesuffix(f".{fields[0]}") for key in tensors if key.endswith(f".{fields[0]}")]
    return {n: cls(*(tensors[f"{n}.{f}"] for f in fields)) for n in names}


def _read_codes(
    path: Path,
    layout: Layout,
    take: Callable[[GGUFFile, str], C | None],
    quantize: Callable[[torch.Tensor], C],
    head: Literal["own", "any"] | None = None,
) -> dict[str, C] | None:
    """A GGUF file's linear weights as codes: `take(file, name)` a tensor's own (None where its type has
    none; those are quantized by `quantize` from their float32 values), unpermuted and fused as the
    weights are; with `head` the output head's as "lm_head": "own" only where its type has codes, "any"
    quantized otherwise. None when no layer's linear had codes of its own (found before anything is
    quantized)."""
    gguf = GGUFFile(path)
    names = set(gguf.tensor_names())
    linears = {}  # gguf name -> (layer index, the HF name's tail)
    for name in gguf.tensor_names():
        if name.startswith("blk."):
            _, idx, rest = name.split(".", 2)
            hf = _GGUF_BLOCK_NAMES.get(rest, "")
            if hf.endswith("_proj.weight"):
                linears[name] = (idx, hf)
    own = {name: take(gguf, name) for name in linears}
    if all(g is None for g in own.values()):
        return None
    config = hf_config_from_gguf(gguf, has_output_tensor="output.weight" in names)
    permuted = config["model_type"] in ("llama", "mistral")
    codes: dict[str, C] = {}
    for name, (idx, hf) in linears.items():
        rest = name.split(".", 2)[2]
        g = own[name]
        if g is None:
            g = quantize(torch.from_numpy(gguf.tensor(name)))
        heads = {"attn_q.": "num_attention_heads", "attn_k.": "num_key_value_heads"}
        for prefix, key in heads.items():
            if permuted and rest.startswith(prefix):
                g = type(g)(*(_unpermute(getattr(g, f.name), config[key]) for f in dataclasses.fields(g)))
        codes[f"layers.{idx}.{hf}"] = g
    # The layout fuses each field as it fuses the weights (q/k/v, gate/up: rows concatenated).
    kind = type(next(iter(codes.values())))
    fields = [f.name for f in dataclasses.fields(kind)]
    fused = {f: layout.prepare(((name, getattr(g, f)) for name, g in codes.items()), config) for f in fields}
    out = {n.removesuffix(".weight"): kind(*(fused[f][n] for f in fields)) for n in fused[fields[0]]}
    if head:
        g = _head_codes(gguf, take, quantize if head == "any" else None)
        if g is not None:  # else the layer quantizes its own weight, or takes another form
            out["lm_head"] = g
    return out


def _head_codes(
    gguf: GGUFFile, take: Callable[[GGUFFile, str], C | None], quantize: Callable[[torch.Tensor], C] | None
) -> C | None:
    """The output head's codes: output.weight's, or the tied embedding's (GGUF keeps no copy of a tied
    head), by `take`; where its type has none, its float32 values by `quantize` (if given and the width
    is a multiple of the group)."""
    name = "output.weight" if "output.weight" in set(gguf.tensor_names()) else "token_embd.weight"
    g = take(gguf, name)
    if g is None and quantize is not None and gguf.tensor_shape(name)[1] % GROUP == 0:
        g = quantize(torch.from_numpy(gguf.tensor(name)))
    return g


def _load_hf_dir(path: Path, dtype: torch.dtype, layout: Layout) -> Checkpoint:
    config = json.loads((path / "config.json").read_text())
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise ValueError(f"{path}: no *.safetensors files")

    def hf_tensors() -> Iterator[tuple[str, torch.Tensor]]:
        for f in files:
            with safe_open(str(f), framework="pt") as st:
                for name in st.keys():  # noqa: SIM118 - safe_open has no __iter__
                    yield name, st.get_tensor(name).to(dtype)

    state_dict = layout.prepare(hf_tensors(), config)
    return Checkpoint(config, state_dict, Tokenizer.from_dir(path), path)
