"""tokenmill's own C++ CPU kernels, compiled on first use with torch.utils.cpp_extension.

Compilation takes about half a minute and is cached per machine and torch version under the cache
folder; a machine without a C++ compiler falls back to the plain-PyTorch implementations.
"""

from __future__ import annotations

import hashlib
import logging
from pathlib import Path
from types import ModuleType

import torch

from tokenmill.paths import default_cache_dir

log = logging.getLogger(__name__)
_CSRC = Path(__file__).parent / "csrc"
_SOURCES = ["bindings.cpp", "paged_decode.cpp", "fused_ops.cpp"]
_module: ModuleType | None = None
_failed: str | None = None


def build_dir() -> Path:
    # Keyed by a hash of every source and header: torch's loader only notices changes to the .cpp
    # files it is given, and a stale build from another checkout must never be picked up.
    digest = hashlib.sha256()
    for f in sorted(_CSRC.iterdir()):
        digest.update(f.name.encode() + f.read_bytes())
    return default_cache_dir() / "kernels" / f"torch-{torch.__version__}" / digest.hexdigest()[:12]


def cpu_kernels() -> ModuleType:
    """The compiled extension; raises RuntimeError if it cannot be built here."""
    global _module, _failed
    if _module is not None:
        return _module
    if _failed is not None:
        raise RuntimeError(_failed)
    try:
        from torch.utils.cpp_extension import load

        d = build_dir()
        d.mkdir(parents=True, exist_ok=True)
        _module = load(
            name="tokenmill_cpu_kernels",
            sources=[str(_CSRC / s) for s in _SOURCES],
            extra_cflags=["-O3", "-march=native", "-fopenmp"],
            extra_ldflags=["-fopenmp"],
            build_directory=str(d),
            verbose=False,
        )
    except Exception as e:
        _failed = f"could not build the CPU kernels: {e}"
        raise RuntimeError(_failed) from e
    return _module
