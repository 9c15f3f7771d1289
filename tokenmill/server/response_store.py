"""Stored Responses (`store: true`): what `previous_response_id`, GET, DELETE, cancel and background
polling read. In this process's memory, bounded three ways so that a client cannot grow it without
limit: a count of responses, a total of bytes, and a time to live. The oldest go first when a bound is
reached; a response past its time is gone. Each belongs to the API key that made it: another key sees
it as missing, never as someone else's."""

from __future__ import annotations

import asyncio
import hashlib
import json
import math
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any


def owner_of(api_key: str | None) -> str:
    """The store's name for an API key: a digest, so that no key is kept in memory as it is."""
    return hashlib.sha256((api_key or "").encode()).hexdigest()[:24]


@dataclass
class StoredResponse:
    owner: str
    response: dict[str, Any]  # the Response object, as GET returns it
    input_items: list[dict[str, Any]]  # this request's own input, as items with ids
    # The conversation up to and with this response's output, as chat messages without the
    # instructions (which a later response does not inherit): what previous_response_id continues.
    messages: list[dict[str, Any]]
    expires: float
    size: int = 0
    task: asyncio.Task | None = field(default=None, repr=False)  # a background response's generation

    @property
    def terminal(self) -> bool:
        return self.response["status"] in ("completed", "incomplete", "failed", "cancelled")


def _size(entry: StoredResponse) -> int:
    parts = (entry.response, entry.input_items, entry.messages)
    return sum(len(json.dumps(p, separators=(",", ":"))) for p in parts)


class ResponseStore:
    def __init__(self, max_responses: int, max_bytes: int, ttl_s: float) -> None:
        self.max_responses, self.max_bytes, self.ttl_s = max_responses, max_bytes, ttl_s
        self._entries: OrderedDict[str, StoredResponse] = OrderedDict()  # oldest first
        self.bytes = 0

    def __len__(self) -> int:
        return len(self._entries)

    @property
    def max_entry_bytes(self) -> int:
        """The largest response kept: a quarter of the store, so one response never empties it."""
        return self.max_bytes // 4

    def put(self, rid: str, entry: StoredResponse) -> bool:
        """Keep (or replace) a response; False if it alone is over the per-response cap. The oldest
        finished responses make room; a background one still running is never evicted (admission
        bounds how many there are), so no client can cancel another's work by filling the store."""
        self.drop(rid)
        entry.size = _size(entry)
        if entry.size > self.max_entry_bytes:
            return False
        self._expire()
        for old_id in [i for i, e in self._entries.items() if e.terminal]:  # oldest first
            if len(self._entries) < self.max_responses and self.bytes + entry.size <= self.max_bytes:
                break
            self.drop(old_id)
        if not entry.terminal:
            entry.expires = math.inf  # a background response's time starts when it ends
        self._entries[rid] = entry
        self.bytes += entry.size
        return True

    def update(
        self, rid: str, response: dict[str, Any], messages: list[dict[str, Any]] | None = None
    ) -> None:
        """A background response's new state; its byte count follows."""
        entry = self._entries.get(rid)
        if entry is None:
            return
        entry.response = response
        if messages is not None:
            entry.messages = messages
        if entry.terminal and entry.expires == math.inf:  # it has ended: its time to live starts now
            entry.expires = self.expiry()
            self._entries.move_to_end(rid)
        self.bytes -= entry.size
        entry.size = _size(entry)
        self.bytes += entry.size

    def get(self, rid: str, owner: str) -> StoredResponse | None:
        self._expire()
        entry = self._entries.get(rid)
        return entry if entry is not None and entry.owner == owner else None

    def delete(self, rid: str, owner: str) -> bool:
        if self.get(rid, owner) is None:
            return False
        self.drop(rid)
        return True

    def drop(self, rid: str) -> None:
        """Forget a response; a background one still running is cancelled (its ticket goes back)."""
        entry = self._entries.pop(rid, None)
        if entry is not None:
            self.bytes -= entry.size
            if entry.task is not None and not entry.task.done():
                entry.task.cancel()

    def expiry(self) -> float:
        return time.monotonic() + self.ttl_s

    def _expire(self) -> None:
        now = time.monotonic()
        # Finished entries are in the order they ended and all live equally long: the expired ones are
        # at the front, among the running background ones (which never expire while they run).
        expired = []
        for rid, entry in self._entries.items():
            if entry.expires > now and entry.terminal:
                break
            if entry.expires <= now:
                expired.append(rid)
        for rid in expired:
            self.drop(rid)
