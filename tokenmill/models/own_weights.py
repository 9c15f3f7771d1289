"""Letting go of a checkpoint once its model is built.

A cached checkpoint loads as views of one file mapping (safetensors maps the file; weights/loader.py).
Building the model repacks most of it (the linears into oneDNN's layout or the kernels' panels), but
the embedding, the norms and any biases stay views of the mapping, and while one view lives the whole
mapping does, with every page the build touched still resident: 257 MB of SmolLM2-135M's 270 MB file
beside the model's own copies of the same weights (measured in /proc/self/smaps, AMD EPYC Zen 4).
Copying out what the model still uses of the checkpoint lets the mapping go.

Where the model still uses most of the checkpoint as it is (the plain PyTorch path, whose linears are
views of the file), the mapping is kept: its pages are then the model itself, and processes that load
the same file share them.
"""

from __future__ import annotations

import torch
from torch import nn

# Copy out below this share of the checkpoint's bytes still in use; above it the mapping is the model.
OWN_BELOW = 0.5


def _key(t: torch.Tensor) -> tuple[int, tuple[int, ...], tuple[int, ...], torch.dtype]:
    return (t.data_ptr(), tuple(t.shape), tuple(t.stride()), t.dtype)


def own_remaining(model: nn.Module, state_dict: dict[str, torch.Tensor]) -> int:
    """Give the model its own copies of the CPU tensors it still shares with `state_dict` (parameters,
    buffers, and tensors modules keep as plain attributes, such as a packed linear's bias), when those are
    less than OWN_BELOW of the checkpoint's bytes; returns the bytes copied (0 when nothing was). Tensors
    that shared one view keep sharing their copy, so tied weights stay tied (two different views of one
    tensor get a copy each: the models here hold none). Tensors kept only inside other objects (a list, a
    kernel's attributes) are not seen; tests/test_own_weights.py checks that a built model's mapping goes."""
    cpu = [t for t in state_dict.values() if t.device.type == "cpu"]
    storages = {t.untyped_storage().data_ptr() for t in cpu}
    if not storages:
        return 0
    total = sum({t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in cpu}.values())

    def shared(t: object) -> bool:
        return (
            isinstance(t, torch.Tensor)
            and t.device.type == "cpu"
            and t.layout == torch.strided
            and not t.is_mkldnn  # oneDNN's packed weights: its own memory, and no storage to ask
            and t.untyped_storage().data_ptr() in storages
        )

    found: dict[tuple, torch.Tensor] = {}
    for module in model.modules():
        for table in (module._parameters, module._buffers, vars(module)):
            for value in table.values():
                if shared(value):
                    found.setdefault(_key(value), value)
    used = sum(t.numel() * t.element_size() for t in found.values())
    if not found or used >= OWN_BELOW * total:
        return 0
    copies = {key: t.detach().clone() for key, t in found.items()}
    for module in model.modules():
        for p in module._parameters.values():
            if shared(p):
                p.data = copies[_key(p)]  # the same Parameter object: ties between modules hold
        for name, b in list(module._buffers.items()):
            if shared(b):
                module._buffers[name] = copies[_key(b)]
        for name, value in list(vars(module).items()):
            if shared(value) and name not in ("_parameters", "_buffers"):
                setattr(module, name, copies[_key(value)])
    return used
