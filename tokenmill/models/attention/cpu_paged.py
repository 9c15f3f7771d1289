"""CPU attention backend: decode rows attend through block tables in place (a C++ kernel).

The reference backend copies every decode row's KV out of the paged cache each layer; at batch 64
with a few hundred tokens of context that copy was most of the step. This backend reads the cache
where it lies instead, 8-bit rows included (converted as they are read), and writes 8-bit rows with
one kernel call per layer. Prefill segments are large enough that the reference path serves them well.
"""

from __future__ import annotations

import torch

from tokenmill.kernels import cpu_kernels
from tokenmill.models.attention.backend import AttentionMetadata
from tokenmill.models.attention.torch_ref import TorchReferenceBackend

_FORMAT_CODES = {None: 0, "int8": 1, "fp8": 2}  # the kernel's kv_format argument


class CpuPagedBackend(TorchReferenceBackend):
    name = "cpu"

    def __init__(self, level: str | None = None, kv_format: str | None = None) -> None:
        """`level`: an instruction-set build of the kernel (tokenmill/kernels/isa.py); default the best."""
        super().__init__(kv_format)
        self.kernels = cpu_kernels(level)
        self._format_code = _FORMAT_CODES[kv_format]

    def _write(
        self,
        k: torch.Tensor,
        v: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        slots: torch.Tensor,
    ) -> None:
        if self.kv_format is None or k.device.type != "cpu":
            super()._write(k, v, k_cache, v_cache, slots)
        else:
            self.kernels.kv_write_q8(k, v, k_cache, v_cache, slots, self.kv_format == "fp8")

    def _decode(
        self,
        q: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
    ) -> torch.Tensor:
        assert meta.decode_block_tables is not None and meta.decode_context_lens is not None
        return self.kernels.paged_decode(
            q, k_cache, v_cache, meta.decode_block_tables, meta.decode_context_lens, scale, self._format_code
        )
