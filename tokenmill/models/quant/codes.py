"""A checkpoint's codes cut to the part of the model a rank holds, as its weights are."""

from __future__ import annotations

import dataclasses
from typing import Any

from tokenmill.models.parallel_linear import ParallelLinear
from tokenmill.weights.group_codes import C


def shard_codes(model: Any, codes: dict[str, C]) -> dict[str, C]:
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
