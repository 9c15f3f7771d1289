"""CPU attention backend: decode rows attend through block tables in place (a small C++ kernel).

The reference backend copies every decode row's KV out of the paged cache each layer; at batch 64
with a few hundred tokens of context that copy is most of the step. This backend reads the cache
where it lies instead. Prefill segments are large enough that the reference path serves them well.
The kernel is compiled on first use (about half a minute, then cached per machine).
"""

from __future__ import annotations

import logging
from pathlib import Path
from types import ModuleType

import torch

from tokenmill.models.attention.backend import AttentionMetadata
from tokenmill.models.attention.torch_ref import TorchReferenceBackend

log = logging.getLogger(__name__)
_SOURCE = Path(__file__).parent / "csrc" / "paged_decode.cpp"
_module: ModuleType | None = None


def build_dir() -> Path:
    from tokenmill.weights.loader import default_cache_dir

    return default_cache_dir() / "kernels" / f"torch-{torch.__version__}"


def load_kernel() -> ModuleType:
    """Compile (once per machine and torch version) and import the C++ kernel."""
    global _module
    if _module is None:
        from torch.utils.cpp_extension import load

        d = build_dir()
        d.mkdir(parents=True, exist_ok=True)
        _module = load(
            name="tokenmill_paged_decode",
            sources=[str(_SOURCE)],
            extra_cflags=["-O3", "-march=native", "-ffast-math", "-fopenmp"],
            extra_ldflags=["-fopenmp"],
            build_directory=str(d),
            verbose=False,
        )
    return _module


class CpuPagedBackend(TorchReferenceBackend):
    name = "cpu"

    def __init__(self) -> None:
        self.kernel = load_kernel()

    def _decode(
        self,
        q: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
    ) -> torch.Tensor:
        assert meta.decode_block_tables is not None and meta.decode_context_lens is not None
        return self.kernel.paged_decode(
            q, k_cache, v_cache, meta.decode_block_tables, meta.decode_context_lens, scale
        )
