"""Attention backends by name."""

from __future__ import annotations

from tokenmill.models.attention.backend import AttentionBackend
from tokenmill.models.attention.torch_ref import TorchReferenceBackend

BACKENDS: dict[str, type[AttentionBackend]] = {"torch": TorchReferenceBackend}


def get_backend(name: str) -> AttentionBackend:
    if name not in BACKENDS:
        raise ValueError(f"unknown attention backend {name!r}; available: {', '.join(BACKENDS)}")
    return BACKENDS[name]()
