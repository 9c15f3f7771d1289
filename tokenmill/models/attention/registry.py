"""Attention backends by name, and the choice of a default."""

from __future__ import annotations

import logging

from tokenmill.models.attention.backend import AttentionBackend
from tokenmill.models.attention.torch_ref import TorchReferenceBackend

log = logging.getLogger(__name__)

BACKEND_NAMES = ("auto", "torch", "cpu")


def get_backend(name: str, device_type: str = "cpu") -> AttentionBackend:
    """ "torch": the plain-PyTorch reference; "cpu": the paged C++ decode kernel; "auto": the fastest
    one that works on this device (falling back to the reference if the kernel cannot be built)."""
    if name not in BACKEND_NAMES:
        raise ValueError(f"unknown attention backend {name!r}; available: {', '.join(BACKEND_NAMES)}")
    if name == "torch" or (name == "auto" and device_type != "cpu"):
        return TorchReferenceBackend()
    from tokenmill.models.attention.cpu_paged import CpuPagedBackend

    try:
        return CpuPagedBackend()
    except Exception as e:  # a machine without a compiler: slower, still correct
        if name == "cpu":
            raise
        log.warning("paged CPU attention kernel unavailable (%s); using the reference backend", e)
        return TorchReferenceBackend()
