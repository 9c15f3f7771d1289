"""Reference attention backend in plain PyTorch: gathers each request's KV through its block table."""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

from tokenmill.models.attention.backend import AttentionBackend, AttentionMetadata, PrefillSegment
from tokenmill.models.attention.kv_quant import check_format, dequantize_rows, quantize_rows


class TorchReferenceBackend(AttentionBackend):
    name = "torch"

    def __init__(self, kv_format: str | None = None) -> None:
        check_format(kv_format)
        self.kv_format = kv_format

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
        window: int = 0,
    ) -> torch.Tensor:
        # Write first: a request may read blocks that another request of this same step fills
        # (early reuse of a block the moment it is full).
        self._write(k, v, k_cache, v_cache, meta.slot_mapping)
        # A sliding window (Gemma 3's local layers, Mistral's) binds only on a context longer than it:
        # those rows take this file's SDPA with the window in its masks, whatever the backend (the C++
        # kernels take no window); the others the backend's own path.
        nd = meta.num_decode
        decode = self._decode
        if window and nd and meta.longest_decode_context() > window:
            decode = functools.partial(self._sdpa_decode, window=window)
        if nd == q.shape[0]:  # a pure decode step: no copy into a combined output
            return decode(q, k_cache, v_cache, meta, scale)
        out = torch.empty_like(q)
        if nd:
            out[:nd] = decode(q[:nd], k_cache, v_cache, meta, scale)
        far = [s for s in meta.prefills if s.context_len > window] if window else []
        if far:
            near = [s for s in meta.prefills if s.context_len <= window]
            self._sdpa_prefill(q, k, v, k_cache, v_cache, far, scale, out, window)
            if near:
                self._prefill(q, k, v, k_cache, v_cache, near, scale, out)
        else:
            self._prefill(q, k, v, k_cache, v_cache, meta.prefills, scale, out)
        return out

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
        """Each prefill segment's attention into its rows of `out` (faster backends override it)."""
        self._sdpa_prefill(q, k, v, k_cache, v_cache, segments, scale, out)

    def _sdpa_prefill(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        segments: list[PrefillSegment],
        scale: float,
        out: torch.Tensor,
        window: int = 0,
    ) -> None:
        """Each prefill segment's attention into its rows of `out`, by SDPA (the semantics), within a
        sliding `window` where one is given."""
        num_kv = k.shape[1]
        for seg in segments:
            qs = q[seg.q_start : seg.q_start + seg.q_len].transpose(0, 1).unsqueeze(0)  # [1, H, n, D]
            if seg.start_pos == 0:
                # Nothing cached before this chunk: its own K/V are the whole context.
                ks = k[seg.q_start : seg.q_start + seg.q_len]
                vs = v[seg.q_start : seg.q_start + seg.q_len]
            else:
                if seg.first_block is not None:
                    blocks = slice(seg.first_block, seg.first_block + len(seg.block_ids))
                    ks, vs = k_cache[blocks], v_cache[blocks]
                else:
                    ks, vs = k_cache[seg.block_ids], v_cache[seg.block_ids]
                ks = self._values(ks.reshape(-1, num_kv, ks.shape[-1])[: seg.context_len], q.dtype)
                vs = self._values(vs.reshape(-1, num_kv, vs.shape[-1])[: seg.context_len], q.dtype)
            binds = window if window and seg.context_len > window else 0
            if seg.start_pos == 0 and not binds:
                mask, causal = None, True
            else:
                mask, causal = seg.causal_mask(binds), False
            o = F.scaled_dot_product_attention(
                qs,
                ks.transpose(0, 1).unsqueeze(0),
                vs.transpose(0, 1).unsqueeze(0),
                attn_mask=mask,
                is_causal=causal,
                scale=scale,
                enable_gqa=True,
            )
            out[seg.q_start : seg.q_start + seg.q_len] = o[0].transpose(0, 1)

    def _write(
        self,
        k: torch.Tensor,
        v: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        slots: torch.Tensor,
    ) -> None:
        """The step's keys and values into their cache slots (as 8-bit rows when the cache is)."""
        num_blocks, block_size, num_kv, width = k_cache.shape
        if self.kv_format:
            k, v = quantize_rows(k, self.kv_format), quantize_rows(v, self.kv_format)
        k_cache.view(num_blocks * block_size, num_kv, width).index_copy_(0, slots, k)
        v_cache.view(num_blocks * block_size, num_kv, width).index_copy_(0, slots, v)

    def _values(self, rows: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """Cache rows as values of `dtype` (8-bit rows dequantized; others as they are)."""
        return dequantize_rows(rows, self.kv_format, dtype) if self.kv_format else rows

    def _decode(
        self,
        q: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
    ) -> torch.Tensor:
        """The decode rows' attention (faster backends override it)."""
        return self._sdpa_decode(q, k_cache, v_cache, meta, scale)

    def _sdpa_decode(
        self,
        q: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
        window: int = 0,
    ) -> torch.Tensor:
        """The decode rows' attention by SDPA over their gathered blocks, within a sliding `window`."""
        assert meta.decode_block_tables is not None
        bt = meta.decode_block_tables
        b, nb = bt.shape
        _, block_size, num_kv, width = k_cache.shape
        ks = self._values(k_cache[bt].view(b, nb * block_size, num_kv, width), q.dtype).transpose(1, 2)
        vs = self._values(v_cache[bt].view(b, nb * block_size, num_kv, width), q.dtype).transpose(1, 2)
        o = F.scaled_dot_product_attention(
            q.unsqueeze(2), ks, vs, attn_mask=meta.decode_mask(window), scale=scale, enable_gqa=True
        )
        return o.squeeze(2)
