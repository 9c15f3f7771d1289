"""Publishes an engine's KV events on ZeroMQ the way vLLM does, so a router can follow its cache.

Live: a PUB socket; each message is three frames, `[topic, sequence number (8 bytes, big-endian),
msgpack batch]`, the sequence counting from 0 per process. PUB/SUB drops messages (a subscriber that
joins late, a full queue), so consumers watch for gaps and ask the replay socket, a ROUTER, for
everything from a sequence number on: `[identity, b"", start (8 bytes)]` is answered with one
`[identity, b"", topic, seq, payload]` message per buffered batch and an end marker whose sequence
is -1 with an empty payload. The replay socket is served by a thread of its own, so a consumer
catching up never waits behind a forward pass.

The buffer keeps the last `kv_events_buffer_steps` batches. A consumer asking for more than it holds (a
router started, or restarted, long after this worker) gets the worker's whole state instead: one batch
that clears and then stores every block held now, under the sequence number of the last batch
published, so it goes on from the live stream. That state is kept from the events themselves.
"""

from __future__ import annotations

import collections
import contextlib
import logging
import threading
from array import array

import zmq

from tokenmill.config import KVEventsConfig
from tokenmill.engine.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, KVEvent, encode_batch
from tokenmill.engine.protocol import secure_socket, worker_secret

log = logging.getLogger(__name__)
END_SEQ = (-1).to_bytes(8, "big", signed=True)


class KVEventPublisher:
    def __init__(self, config: KVEventsConfig, ctx: zmq.Context | None = None) -> None:
        self.ctx = ctx or zmq.Context.instance()
        self.topic = config.kv_events_topic.encode()
        self.seq = 0
        self._buffer: collections.deque[tuple[int, bytes]] = collections.deque(
            maxlen=config.kv_events_buffer_steps
        )
        self._lock = threading.Lock()
        self._held = HeldBlocks()
        self.pub = self.ctx.socket(zmq.PUB)
        self.pub.setsockopt(zmq.SNDHWM, 100_000)
        self.pub.setsockopt(zmq.LINGER, 0)
        # With the workers' shared secret, over tcp:// only those who know it can subscribe or replay
        # (CURVE, as the engine protocol): the events say which prompts this worker has seen.
        secret = worker_secret()
        secure_socket(self.pub, secret, config.kv_events_endpoint, server=True)
        self.endpoint = _bind(self.pub, config.kv_events_endpoint)
        self.replay_endpoint: str | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        if config.kv_events_replay_endpoint:
            self.replay = self.ctx.socket(zmq.ROUTER)
            self.replay.setsockopt(zmq.LINGER, 0)
            secure_socket(self.replay, secret, config.kv_events_replay_endpoint, server=True)
            self.replay_endpoint = _bind(self.replay, config.kv_events_replay_endpoint)
            self._thread = threading.Thread(target=self._serve_replay, name="kv-event-replay", daemon=True)
            self._thread.start()

    def describe(self) -> dict:
        """Where to listen (the bound addresses: a port of 0 or `*` resolved as far as this host knows)."""
        topic = self.topic.decode()
        return {"endpoint": self.endpoint, "replay_endpoint": self.replay_endpoint, "topic": topic}

    def publish(self, events: list[KVEvent]) -> None:
        if not events:
            return
        payload = encode_batch(events)
        with self._lock:  # the number, the buffer and the state change together: a snapshot sees all or none
            seq = self.seq
            self.seq += 1
            self._buffer.append((seq, payload))
            self._held.apply(events)
        with contextlib.suppress(zmq.Again):  # past the high-water mark PUB drops; replay recovers it
            self.pub.send_multipart([self.topic, seq.to_bytes(8, "big"), payload], zmq.NOBLOCK)

    def _serve_replay(self) -> None:
        while not self._stop.is_set():
            try:
                if not self.replay.poll(200):
                    continue
                frames = self.replay.recv_multipart()
            except zmq.ZMQError:
                return  # the context was closed
            if len(frames) != 3 or len(frames[2]) != 8:
                log.warning("ignored a malformed KV-event replay request (%d frames)", len(frames))
                continue
            ident, start = frames[0], int.from_bytes(frames[2], "big")
            state = None
            with self._lock:
                # Some of what it asks for is no longer buffered: the state instead, copied under the lock
                # (the engine's publish waits only for the copy; the state is built and encoded after).
                if start < self.seq and (not self._buffer or self._buffer[0][0] > start):
                    state, state_seq = self._held.copy(), self.seq - 1
                    batches = []
                else:
                    batches = [(s, p) for s, p in self._buffer if s >= start]
            if state is not None:
                batches = [(state_seq, encode_batch(state.snapshot()))]
            try:
                for s, p in batches:
                    self.replay.send_multipart([ident, b"", self.topic, s.to_bytes(8, "big"), p])
                self.replay.send_multipart([ident, b"", self.topic, END_SEQ, b""])
            except zmq.ZMQError:
                return

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=1)
            self.replay.close(linger=0)
        self.pub.close(linger=0)


class HeldBlocks:
    """The blocks a worker holds now, per tier, as its events say: what a snapshot stores."""

    def __init__(self, blocks: dict | None = None) -> None:
        # (hash, medium) -> (parent hash, tokens (int64 bytes), block size, lora id, lora name, extra key)
        self._blocks: dict[tuple[int, str | None], tuple] = blocks if blocks is not None else {}

    def copy(self) -> HeldBlocks:
        return HeldBlocks(dict(self._blocks))

    def __len__(self) -> int:
        return len(self._blocks)

    def apply(self, events: list[KVEvent]) -> None:
        blocks = self._blocks
        for ev in events:
            if isinstance(ev, BlockStored):
                bs, extra = ev.block_size, ev.extra_keys
                parent = ev.parent_block_hash
                for i, h in enumerate(ev.block_hashes):
                    key = extra[i] if extra is not None and i < len(extra) else None
                    tokens = array(
                        "q", ev.token_ids[i * bs : (i + 1) * bs]
                    ).tobytes()  # a fifth of a list's size
                    blocks[(h, ev.medium)] = (parent, tokens, bs, ev.lora_id, ev.lora_name, key)
                    parent = h
            elif isinstance(ev, BlockRemoved):
                for h in ev.block_hashes:
                    blocks.pop((h, ev.medium), None)
            elif isinstance(ev, AllBlocksCleared):
                blocks.clear()

    def snapshot(self) -> list[KVEvent]:
        """AllBlocksCleared, then every held block stored after its parent, in runs of a chain."""
        blocks = self._blocks
        order: list[tuple[int, str | None]] = []
        placed: set[tuple[int, str | None]] = set()
        for key in blocks:
            chain = []
            k: tuple[int, str | None] | None = key
            while k is not None and k in blocks and k not in placed:  # up to a parent already placed
                chain.append(k)
                placed.add(k)
                parent = blocks[k][0]
                k = (parent, k[1]) if parent is not None else None
            order.extend(reversed(chain))
        events: list[KVEvent] = [AllBlocksCleared()]
        run: BlockStored | None = None
        for h, medium in order:
            parent, tokens, bs, lora_id, lora_name, extra = blocks[(h, medium)]
            if (
                run is not None
                and run.block_hashes[-1] == parent
                and (run.medium, run.lora_id, run.lora_name, run.block_size)
                == (medium, lora_id, lora_name, bs)
                and (run.extra_keys is None) == (extra is None)
            ):
                run.block_hashes.append(h)
                run.token_ids.extend(array("q", tokens))
                if run.extra_keys is not None:
                    run.extra_keys.append(extra)
            else:
                extras = [extra] if extra is not None else None
                run = BlockStored(
                    [h], parent, array("q", tokens).tolist(), bs, lora_id, medium, lora_name, extras
                )
                events.append(run)
        return events


def _bind(sock: zmq.Socket, endpoint: str) -> str:
    sock.bind(endpoint)
    return sock.getsockopt(zmq.LAST_ENDPOINT).decode()
