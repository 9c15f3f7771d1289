"""The model runner: owns the model and the paged KV cache, turns a scheduled step into tensors, runs it."""

from __future__ import annotations

import torch

from tokenmill.engine.kv_cache_manager import KVCacheManager
from tokenmill.engine.sampler import Sampler, SampleResult
from tokenmill.engine.scheduler import SchedulerOutput
from tokenmill.models.attention.backend import AttentionBackend, AttentionMetadata, PrefillSegment
from tokenmill.models.attention.registry import get_backend
from tokenmill.models.config import ModelConfig
from tokenmill.models.llama import LlamaForCausalLM


class ModelRunner:
    def __init__(
        self,
        model: LlamaForCausalLM,
        config: ModelConfig,
        num_blocks: int,
        block_size: int,
        dtype: torch.dtype,
        device: torch.device,
        backend: str = "torch",
        seed: int = 0,
    ) -> None:
        self.model = model
        self.config = config
        self.block_size = block_size
        self.device = device
        self.backend: AttentionBackend = get_backend(backend, device.type)
        self.sampler = Sampler(seed)
        shape = (config.num_layers, 2, num_blocks, block_size, config.num_kv_heads, config.head_dim)
        self.kv_caches = torch.zeros(shape, dtype=dtype, device=device)

    def execute(self, out: SchedulerOutput, kv: KVCacheManager) -> tuple[list[str], SampleResult]:
        """Run one forward pass; return the ids of requests that got a token, and the sampling result."""
        bs = self.block_size
        # Decode rows (one new token) first, then prefill segments: the backend batches the former.
        decodes = [s for s in out.scheduled if s.num_new_tokens == 1]
        prefills = [s for s in out.scheduled if s.num_new_tokens > 1]
        ordered = decodes + prefills

        token_ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        logits_rows: list[int] = []
        sampled_reqs = []
        segments: list[PrefillSegment] = []
        tables: list[list[int]] = []
        for s in ordered:
            req = s.request
            start, end = s.start, s.start + s.num_new_tokens
            block_ids = kv.block_ids(req.request_id)
            q_start = len(token_ids)
            token_ids.extend(req.all_token_ids[start:end])
            positions.extend(range(start, end))
            slots.extend(block_ids[p // bs] * bs + p % bs for p in range(start, end))
            if s.num_new_tokens == 1:
                tables.append(block_ids[: (end + bs - 1) // bs])
            else:
                ids = block_ids[: (end + bs - 1) // bs]
                seg = PrefillSegment(q_start, s.num_new_tokens, start, torch.tensor(ids, dtype=torch.long))
                if ids == list(range(ids[0], ids[0] + len(ids))):  # a run: the context is a cache slice
                    seg.first_block = ids[0]
                segments.append(seg)
            if s.samples:
                logits_rows.append(len(token_ids) - 1)
                sampled_reqs.append(req)

        dev = self.device
        meta = AttentionMetadata(
            slot_mapping=torch.tensor(slots, dtype=torch.long, device=dev),
            num_decode=len(decodes),
            decode_block_tables=None,
            decode_context_lens=None,
            prefills=segments,
            block_size=bs,
        )
        if decodes:
            max_blocks = max(len(t) for t in tables)
            bt = torch.zeros(len(tables), max_blocks, dtype=torch.long)
            for i, t in enumerate(tables):
                bt[i, : len(t)] = torch.tensor(t, dtype=torch.long)
            ctx = torch.tensor([s.start + 1 for s in decodes], dtype=torch.long)
            meta.decode_block_tables = bt.to(dev)
            meta.decode_context_lens = ctx.to(dev)
        for seg in segments:
            seg.block_ids = seg.block_ids.to(dev)

        logits = self.model(
            torch.tensor(token_ids, dtype=torch.long, device=dev),
            torch.tensor(positions, dtype=torch.long, device=dev),
            self.kv_caches,
            meta,
            self.backend,
            torch.tensor(logits_rows, dtype=torch.long, device=dev),
        )
        if not sampled_reqs:
            return [], SampleResult([], [])
        result = self.sampler(logits.cpu(), sampled_reqs)
        return [r.request_id for r in sampled_reqs], result
