"""Embeddings from a generative model's final hidden states: which pooling a model asks for, and the
finishing steps (Matryoshka truncation, L2 normalization) the engine leaves to the frontend.

The engine pools (worker/model_runner.py: the last token, the mean of all, or the first); this module
only decides which and shapes the result. A Sentence Transformers folder says how it pools in
`1_Pooling/config.json` and whether it normalizes in `modules.json`; anything else is pooled as
decoder-only embedding models are (the last token, normalized), as vLLM does.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

# Sentence Transformers' pooling modes -> the engine's.
_ST_MODES = {
    "pooling_mode_lasttoken": "last",
    "pooling_mode_mean_tokens": "mean",
    "pooling_mode_cls_token": "cls",
}


@dataclass(frozen=True)
class Pooling:
    type: str = "last"  # "last", "mean" or "cls"
    normalize: bool = True


def model_pooling(model: str) -> Pooling:
    """How the model at `model` (a folder, a file or a catalog name) pools its embeddings."""
    folder = Path(model)
    config = folder / "1_Pooling" / "config.json"
    if not folder.is_dir() or not config.is_file():
        return Pooling()
    settings = json.loads(config.read_text())
    kind = next((mode for key, mode in _ST_MODES.items() if settings.get(key)), None)
    if kind is None:
        raise ValueError(f"{config}: no pooling mode this engine runs (last token, mean or CLS)")
    normalize = False
    modules = folder / "modules.json"
    if modules.is_file():
        normalize = any("Normalize" in str(m.get("type", "")) for m in json.loads(modules.read_text()))
    return Pooling(kind, normalize)


def finish(vector: list[float], normalize: bool, dimensions: int | None = None) -> list[float]:
    """The embedding a client gets: cut to `dimensions` (Matryoshka style: the leading ones), then
    scaled to unit length when `normalize`."""
    if dimensions is not None:
        if not 1 <= dimensions <= len(vector):
            raise ValueError(f"dimensions must be between 1 and {len(vector)}, got {dimensions}")
        vector = vector[:dimensions]
    if not normalize:
        return list(vector)
    norm = math.sqrt(math.fsum(x * x for x in vector))
    return [x / norm for x in vector] if norm > 0 else list(vector)
