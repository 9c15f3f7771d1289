"""Which adapter a request runs on, as plain data that crosses every process boundary with the request.

A request names its adapter whole (name, id, path): the engine core needs no registration message, a
routed worker learns the adapter from the request itself, and the workers read its files when they first
give it a slot. The name enters the KV cache's identity (`kv_salt`): blocks computed under one adapter are
never prefix hits for another, or for the base, and a router that hashes a prompt with the same salt
counts only blocks cached under the same adapter.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class LoRARequest:
    """vLLM's shape: a name clients use as a model name, a positive id unique to this load of the
    adapter (a reload gets a new one, so its slot is read again), and the PEFT directory."""

    lora_name: str
    lora_int_id: int
    lora_path: str

    def __post_init__(self) -> None:
        if self.lora_int_id < 1:
            raise ValueError(f"lora_int_id must be positive, got {self.lora_int_id}")
        if not self.lora_name:
            raise ValueError("lora_name is empty")


# Separates the adapter's part of the salt from a client's cache_salt (which is free text).
_LORA_MARK = "\x00lora\x00"


def kv_salt(cache_salt: str | None, lora_name: str | None) -> str | None:
    """What the first block's hash is salted with: the client's cache salt and the adapter's name."""
    if lora_name is None:
        return cache_salt
    return f"{cache_salt or ''}{_LORA_MARK}{lora_name}"
