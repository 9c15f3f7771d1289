"""CPU attention backend: decode rows attend through block tables in place (a C++ kernel).

The reference backend copies every decode row's KV out of the paged cache each layer; at batch 64
with a few hundred tokens of context that copy was most of the step. This backend reads the cache
where it lies instead, 8-bit rows included (converted as they are read), and writes 8-bit rows with
one kernel call per layer. Prompt segments (bf16 queries) go to a causal attention kernel on oneDNN's
brgemm micro-kernel where the CPU has AMX or AVX512-BF16 (linear.bf16_brgemm_available): whole prompts
read their own keys and values, chunks that continue a cached context read it through their block
tables; other dtypes and CPUs take the reference path's SDPA.
"""

from __future__ import annotations

import torch

from tokenmill.kernels import cpu_kernels
from tokenmill.models.attention.backend import AttentionMetadata, PrefillSegment
from tokenmill.models.attention.torch_ref import TorchReferenceBackend
from tokenmill.models.linear import amx_brgemm_available, bf16_brgemm_available

_FORMAT_CODES = {None: 0, "int8": 1, "fp8": 2}  # the kernel's kv_format argument
# Shortest chunk after a cached context that the prompt kernel takes (see _prefill): with AMX, where
# SDPA is fast, 192; without it (AVX512-BF16: AMD Zen 4), where SDPA runs at ~100 GFLOP/s, 16. On Zen 4
# the kernel was 1.13-1.29x SDPA at 16 queries after 300-3000 cached tokens, 1.01-1.14x at 8, 0.94-1.09x
# at 4 (`python benchmarks/prefill_attention.py --cached ... --cached-min-queries 1`).
CACHED_MIN_QUERIES = {"amx": 192, "avx512_bf16": 16}


class CpuPagedBackend(TorchReferenceBackend):
    name = "cpu"

    def __init__(self, level: str | None = None, kv_format: str | None = None) -> None:
        """`level`: an instruction-set build of the kernel (tokenmill/kernels/isa.py); default the best."""
        super().__init__(kv_format)
        self.kernels = cpu_kernels(level)
        self.format_code = _FORMAT_CODES[kv_format]
        self.prompt_kernel = bf16_brgemm_available()
        self.cached_min_queries = CACHED_MIN_QUERIES["amx" if amx_brgemm_available() else "avx512_bf16"]

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

    def _prefill(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        segments: list[PrefillSegment],
        scale: float,
        out: torch.Tensor,
    ) -> None:
        usable = (
            self.prompt_kernel
            and q.dtype == torch.bfloat16
            and q.device.type == "cpu"
            and q.shape[-1] % 32 == 0
            and (self.kv_format is not None or k_cache is None or k_cache.dtype == torch.bfloat16)
        )
        if not usable:
            super()._prefill(q, k, v, k_cache, v_cache, segments, scale, out)
            return
        whole = [s for s in segments if s.start_pos == 0]
        if whole:
            starts = torch.tensor([s.q_start for s in whole], dtype=torch.long)
            lens = torch.tensor([s.q_len for s in whole], dtype=torch.long)
            self.kernels.prefill_attention(q, k, v, out, starts, lens, scale)
        # Chunks after a cached context (chunked prefill, prefix hits): the context is read through the
        # block tables, this chunk's keys included (written above). Gathering and packing the context
        # costs what a short chunk's products do: with AMX, below ~160 queries SDPA was faster (64
        # queries after 3000 cached tokens: 0.67x; 128: 0.95x; 256: 1.06x; 2048 after 2048: 1.56x), so
        # short chunks (draft verification among them) stay with it. On AMD Zen 4 the kernel won at
        # every size measured: 32 after 300 cached 1.36x, 64 after 3000 1.59x, 128 after 3000 2.23x.
        later = [s for s in segments if s.start_pos != 0]
        rest = [s for s in later if s.q_len >= self.cached_min_queries]
        short = [s for s in later if s.q_len < self.cached_min_queries]
        if short:
            super()._prefill(q, k, v, k_cache, v_cache, short, scale, out)
        if rest:
            width = max(len(s.block_ids) for s in rest)
            tables = torch.zeros(len(rest), width, dtype=torch.long)
            for i, s in enumerate(rest):
                tables[i, : len(s.block_ids)] = s.block_ids
            self.kernels.prefill_attention_cached(
                q,
                out,
                k_cache,
                v_cache,
                torch.tensor([s.q_start for s in rest], dtype=torch.long),
                torch.tensor([s.q_len for s in rest], dtype=torch.long),
                torch.tensor([s.start_pos for s in rest], dtype=torch.long),
                tables,
                scale,
                self.format_code,
            )

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
            q, k_cache, v_cache, meta.decode_block_tables, meta.decode_context_lens, scale, self.format_code
        )
