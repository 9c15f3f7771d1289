"""Which adapter a request runs on, as plain data that crosses every process boundary with the request.

A request names its adapter whole (name, id, path): the engine core needs no registration message, a
routed worker learns the adapter from the request itself, and the workers read its files when they first
give it a slot. The adapter enters the KV cache's identity (`kv_salt`): its name, directory and a
fingerprint of its weights file, so blocks computed under one adapter are never prefix hits for another,
for the base, or for the same name loaded again with other weights (also from a file tier that outlived
a restart); a router that hashes a prompt with the same salt counts only blocks cached under the same
adapter.
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
    # The weights file's size and modification time (lora/adapter.py's fingerprint), filled in when the
    # adapter is checked: part of the KV cache's identity.
    fingerprint: str = ""

    @property
    def cache_key(self) -> str:
        return f"{self.lora_name}\x00{self.lora_path}\x00{self.fingerprint}"

    def __post_init__(self) -> None:
        if self.lora_int_id < 1:
            raise ValueError(f"lora_int_id must be positive, got {self.lora_int_id}")
        if not self.lora_name:
            raise ValueError("lora_name is empty")


# Separates the adapter's part of the salt from a client's cache_salt (which is free text).
_LORA_MARK = "\x00lora\x00"


def kv_salt(cache_salt: str | None, lora: LoRARequest | None) -> str | None:
    """What the first block's hash is salted with: the client's cache salt (which may hold no NUL, so it
    cannot pose as an adapter's part) and the adapter's identity."""
    if lora is None:
        return cache_salt
    return f"{cache_salt or ''}{_LORA_MARK}{lora.cache_key}"
