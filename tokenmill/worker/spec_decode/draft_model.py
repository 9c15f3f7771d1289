"""A draft model: a smaller (or 4-bit) model with the target's tokenizer guesses the next tokens greedily.

It runs in the worker beside the target, with a paged KV cache of its own (its own blocks, its own
block tables), so it never touches the target's cache, prefix sharing or KV events. Per request it
remembers which tokens its cache holds. Each step the context is compared with them: the common
prefix stays, the rest (rejected drafts) is dropped, and the tokens the draft has not seen (the ones
the target accepted, its own token) are fed in one pass that also yields the first guess; then one
decode pass per further guess, all requests batched. Guesses are the draft's argmax: deterministic,
as the verifier assumes (q = 1), so the target's distribution is kept whatever the draft says.

A request whose cache does not fit in the draft's pool gets no drafts that step (it is never failed).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from tokenmill.models.attention.backend import AttentionBackend, AttentionMetadata, PrefillSegment
from tokenmill.models.attention.registry import get_backend
from tokenmill.models.decode_step import decode_step_for
from tokenmill.models.llama import LlamaForCausalLM
from tokenmill.worker.kv_spec import KVCacheSpec
from tokenmill.worker.spec_decode.proposer import ProposeInput, Proposer

if TYPE_CHECKING:
    from tokenmill.tokenizer.tokenizer import Tokenizer


@dataclass
class _Seq:
    tokens: list[int] = field(default_factory=list)  # tokens whose keys and values the draft cache holds
    blocks: list[int] = field(default_factory=list)


class DraftModelProposer(Proposer):
    # Fed tokens up to this many (accepted guesses and the target's token: at most 33) go in as decode
    # rows; more (a prompt) as a prefill segment.
    MAX_ROWS_PER_REQUEST = 33
    costly = True

    def __init__(
        self,
        model: LlamaForCausalLM,
        num_blocks: int,
        block_size: int,
        dtype: torch.dtype,
        device: torch.device,
        backend: str = "torch",
        max_model_len: int | None = None,
        kv_format: str | None = None,
    ) -> None:
        self.model = model
        model.layer_loop = decode_step_for(model)  # decode passes in C++, as the target's (model_runner.py)
        self.block_size = block_size
        self.device = device
        cfg = model.config
        layers, kv_heads = model.num_local_layers, model.num_local_kv_heads
        spec = KVCacheSpec(block_size, layers, kv_heads, cfg.head_dim, dtype.itemsize, kv_format)
        shape, storage = spec.tensor_shape(num_blocks), spec.storage_dtype(dtype)
        self.kv_caches = torch.zeros(shape, dtype=storage, device=device)
        self.free = list(range(num_blocks - 1, -1, -1))
        self.backend: AttentionBackend = get_backend(backend, device.type, kv_format)
        self.max_len = max_model_len or cfg.max_position_embeddings
        self.seqs: dict[str, _Seq] = {}

    # -- the proposer interface ---------------------------------------------------------------------
    def propose(self, batch: list[ProposeInput]) -> list[list[int]]:
        guesses: list[list[int]] = [[] for _ in batch]
        feed: list[tuple[int, _Seq, list[int]]] = []  # (index in batch, its sequence, tokens to feed)
        want = [min(b.k, self.max_len - len(b.context)) for b in batch]  # guesses that fit the context
        for i, b in enumerate(batch):
            k = want[i]
            seq = self.seqs.setdefault(b.request_id, _Seq())
            keep = _common_prefix(seq.tokens, b.context, len(b.context) - 1)  # feed at least one token
            self._truncate(seq, keep)
            # The cache must hold the context and every guess but the last (never fed).
            if k <= 0 or not self._reserve(seq, len(b.context) + k - 1):
                self._release(b.request_id)
                continue
            feed.append((i, seq, list(b.context[keep:])))
        while feed:
            nxt = self._forward(feed)
            more = []
            for (i, seq, tokens), t in zip(feed, nxt, strict=True):
                seq.tokens.extend(tokens)
                guesses[i].append(t)
                if len(guesses[i]) < want[i]:
                    more.append((i, seq, [t]))
            feed = more
        return guesses

    def held(self, request_id: str) -> int | None:
        seq = self.seqs.get(request_id)
        return None if seq is None else len(seq.tokens)

    def forget(self, request_ids, outputs=None) -> None:  # noqa: ANN001 - the interface's signature
        for rid in request_ids:
            self._release(rid)

    # -- the draft's cache --------------------------------------------------------------------------
    def _reserve(self, seq: _Seq, num_tokens: int) -> bool:
        need = -(-num_tokens // self.block_size) - len(seq.blocks)
        if need > len(self.free):
            return False
        seq.blocks.extend(self.free.pop() for _ in range(max(need, 0)))
        return True

    def _truncate(self, seq: _Seq, num_tokens: int) -> None:
        del seq.tokens[num_tokens:]
        keep = -(-num_tokens // self.block_size)
        self.free.extend(reversed(seq.blocks[keep:]))
        del seq.blocks[keep:]

    def _release(self, request_id: str) -> None:
        seq = self.seqs.pop(request_id, None)
        if seq is not None:
            self.free.extend(reversed(seq.blocks))

    # -- one pass -----------------------------------------------------------------------------------
    def _forward(self, feed: list[tuple[int, _Seq, list[int]]]) -> list[int]:
        """Feed each sequence its tokens (decode rows for one, a prefill segment for more) and return
        each one's argmax after its last token."""
        bs, dev = self.block_size, self.device
        order = sorted(range(len(feed)), key=lambda j: len(feed[j][2]) > self.MAX_ROWS_PER_REQUEST)
        token_ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        last_rows = [0] * len(feed)
        tables: list[list[int]] = []
        ctx_lens: list[int] = []
        segments: list[PrefillSegment] = []
        for j in order:
            _, seq, tokens = feed[j]
            start, n = len(seq.tokens), len(tokens)
            q_start = len(token_ids)
            token_ids.extend(tokens)
            positions.extend(range(start, start + n))
            slots.extend(seq.blocks[p // bs] * bs + p % bs for p in range(start, start + n))
            if n <= self.MAX_ROWS_PER_REQUEST:
                # Catching up on a few tokens: decode rows, as the target verifies drafts (the pass
                # writes every row's keys and values before any row attends).
                for pos in range(start, start + n):
                    tables.append(seq.blocks[: pos // bs + 1])
                    ctx_lens.append(pos + 1)
            else:
                ids = torch.tensor(seq.blocks[: (start + n + bs - 1) // bs], dtype=torch.long)
                segments.append(PrefillSegment(q_start, n, start, ids))
            last_rows[j] = len(token_ids) - 1
        meta = AttentionMetadata.of(slots, tables, ctx_lens, segments, bs, dev)
        logits = self.model(
            torch.tensor(token_ids, dtype=torch.long, device=dev),
            torch.tensor(positions, dtype=torch.long, device=dev),
            self.kv_caches,
            meta,
            self.backend,
            torch.tensor(last_rows, dtype=torch.long, device=dev),
        )
        return logits.max(dim=-1).indices.tolist()


def check_draft_vocabulary(target: Tokenizer, draft: Tokenizer, name: str) -> None:
    """A draft's token ids must mean what the target's mean: the same vocabulary, id for id."""
    if target.backend.get_vocab(with_added_tokens=True) != draft.backend.get_vocab(with_added_tokens=True):
        raise ValueError(
            f"draft model {name!r} has another vocabulary than the target: its guesses would be noise"
        )


def _common_prefix(a: list[int], b, limit: int) -> int:  # noqa: ANN001 - any sequence of ints
    # A request's context only grows, and only the draft's own guesses (its last fed tokens, at most
    # 32) can differ from it: the comparison starts a little before those instead of at 0.
    n = min(len(a), len(b), limit)
    i = max(0, n - 40)
    while i < n and a[i] == b[i]:
        i += 1
    return i
