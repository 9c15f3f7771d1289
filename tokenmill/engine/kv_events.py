"""KV cache events in vLLM's wire format, so that a router of another project (Dynamo, llm-d) can read
ours and ours can read theirs.

A batch is a positional array `[ts, events, data_parallel_rank]`; each event a map tagged by "type"
(vLLM since mid-2026; older releases sent events as positional arrays too, which `decode_batch` also
accepts). Block hashes go out as vLLM's default does: the low 64 bits of the chained block hash, as an
unsigned integer. Every BlockStored, of every tier (the device pool's and the host tier's), carries its
token ids, block size and parent hash, so a consumer that hashes tokens its own way (Dynamo) can chain
them without knowing our hash function.

The fields sent, and their order, are vLLM's (vllm/distributed/kv_events.py, v0.32). vLLM's decoder requires
every field that has no default there (BlockStored's lora_id, medium and lora_name, BlockRemoved's
medium, even when null): they have none here either, so they are always written.

Torch-free: the router imports this.
"""

from __future__ import annotations

import time
from typing import Any

import msgspec

MEDIUM_DEVICE = "GPU"  # vLLM's name for the device pool (also on CPU), which consumers key tiers on
_MASK64 = (1 << 64) - 1


def external_hash(block_hash: bytes) -> int:
    """The published name of a block: the low 64 bits of its hash, unsigned (vLLM's default)."""
    return int.from_bytes(block_hash, "big") & _MASK64


class BlockStored(msgspec.Struct, tag_field="type", tag="BlockStored", omit_defaults=True, gc=False):
    block_hashes: list[int]
    parent_block_hash: int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None  # vLLM's deprecated numeric adapter id (None: the base model)
    medium: str | None  # "GPU" for the device pool, "CPU" for the host tier
    lora_name: str | None
    # vLLM carries the cache salt (and LoRA name) in per-block extra keys; the salt enters only the
    # first block of a prompt, and through the chain every later one.
    extra_keys: list[list[Any] | None] | None = None


class BlockRemoved(msgspec.Struct, tag_field="type", tag="BlockRemoved", omit_defaults=True, gc=False):
    block_hashes: list[int]
    medium: str | None


class AllBlocksCleared(msgspec.Struct, tag_field="type", tag="AllBlocksCleared", gc=False):
    pass


KVEvent = BlockStored | BlockRemoved | AllBlocksCleared


class EventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list[KVEvent]
    data_parallel_rank: int | None = None


_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(EventBatch)
_legacy_fields = {
    "BlockStored": list(BlockStored.__struct_fields__),
    "BlockRemoved": list(BlockRemoved.__struct_fields__),
    "AllBlocksCleared": [],
}
# What a field missing from an older payload meant: vLLM before `medium` (#19737) and `lora_name`
# (#27577) had only the device pool, and tokenmill's workers before issue 50 left these fields out when
# they held these values. A router reads old and new workers alike during an upgrade.
_missing_means: dict[str, Any] = {"lora_id": None, "medium": MEDIUM_DEVICE, "lora_name": None}


def stored(
    block_hashes: list[int],
    parent_block_hash: int | None,
    token_ids: list[int],
    block_size: int,
    medium: str = MEDIUM_DEVICE,
    extra_keys: list[list[Any] | None] | None = None,
    lora: tuple[int, str] | None = None,
) -> BlockStored:
    """A BlockStored of a block run, computed under a LoRA adapter ((lora id, name)) or the base model."""
    lora_id, lora_name = lora if lora is not None else (None, None)
    return BlockStored(
        block_hashes, parent_block_hash, token_ids, block_size, lora_id, medium, lora_name, extra_keys
    )


def encode_batch(events: list[KVEvent], dp_rank: int | None = None) -> bytes:
    return _encoder.encode(EventBatch(time.time(), events, dp_rank))


def decode_batch(payload: bytes) -> EventBatch:
    """A batch in the current layout (map events), or the legacy one (array events, tag first)."""
    try:
        return _decoder.decode(payload)
    except msgspec.ValidationError:
        pass
    raw = msgspec.msgpack.decode(payload)
    if isinstance(raw, dict):
        ts, events, dp = raw.get("ts", 0.0), raw.get("events", []), raw.get("data_parallel_rank")
    else:
        ts, events, dp = raw[0], raw[1], raw[2] if len(raw) > 2 else None
    out: list[KVEvent] = []
    for ev in events:
        if isinstance(ev, list):  # legacy: ["BlockStored", field, field, ...]
            names = _legacy_fields.get(ev[0])
            if names is None:
                continue
            ev = {"type": ev[0], **dict(zip(names, ev[1:], strict=False))}
        kind = ev.get("type")
        if kind not in _legacy_fields:
            continue  # an event kind we do not index (a newer vLLM's): skip, do not fail the batch
        fields = {k: v for k, v in ev.items() if k in _legacy_fields[kind]}
        for key in _legacy_fields[kind]:
            if key not in fields and key in _missing_means:
                fields[key] = _missing_means[key]
        for key in ("block_hashes", "parent_block_hash"):
            fields[key] = _as_ints(fields.get(key))
        out.append(msgspec.convert({"type": kind, **fields}, KVEvent))
    return EventBatch(float(ts), out, dp)


def _as_ints(v: Any) -> Any:
    """Hashes may arrive as signed or unsigned 64-bit ints, or as raw digest bytes."""
    if v is None:
        return None
    if isinstance(v, list):
        return [_as_ints(x) for x in v]
    if isinstance(v, bytes):
        return external_hash(v)
    return int(v) & _MASK64
