"""Attention backends by name, and the choice of a default."""

from __future__ import annotations

import logging

from tokenmill.models.attention.backend import AttentionBackend
from tokenmill.models.attention.torch_ref import TorchReferenceBackend

log = logging.getLogger(__name__)

BACKEND_NAMES = ("auto", "torch", "cpu")


def get_backend(name: str, device_type: str = "cpu", kv_format: str | None = None) -> AttentionBackend:
    """ "torch": the plain-PyTorch reference; "cpu": the paged C++ decode kernel at the best
    instruction-set level this CPU runs; a level name (e.g. "avx2"): that build of the kernel; "auto":
    the fastest one that works on this device (falling back to the reference if the kernel cannot be
    built). `kv_format`: how the cache stores keys and values (None: the model's dtype; "int8"/"fp8":
    models/attention/kv_quant.py)."""
    from tokenmill.kernels.isa import level_names

    if name not in (*BACKEND_NAMES, *level_names()):
        names = ", ".join((*BACKEND_NAMES, *level_names()))
        raise ValueError(f"unknown attention backend {name!r}; available: {names}")
    if name == "torch" or (name == "auto" and device_type != "cpu"):
        return TorchReferenceBackend(kv_format)
    from tokenmill.models.attention.cpu_paged import CpuPagedBackend

    try:
        return CpuPagedBackend(None if name in ("auto", "cpu") else name, kv_format)
    except Exception as e:  # a machine without a compiler or without AVX2: slower, still correct
        if name != "auto":
            raise
        log.warning("paged CPU attention kernel unavailable (%s); using the reference backend", e)
        return TorchReferenceBackend(kv_format)
