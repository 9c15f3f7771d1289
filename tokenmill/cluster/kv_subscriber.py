"""Follows one worker's KV events into the router's index, repairing gaps by replay.

PUB/SUB loses messages (a subscriber that joins late, a full queue), so every message's sequence
number is checked: a jump asks the worker's replay socket for what was missed; a replay that cannot
be had (the worker kept too little, or does not answer) leaves the worker's part of the index
unknown, so it is dropped rather than trusted. On joining, a replay from 0 brings in what the worker
already holds: its buffered batches, or, when it has dropped some of them, its whole state in one batch
(engine/kv_publisher.py) that clears the worker's part of the index and stores it anew.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from dataclasses import dataclass

import msgspec
import zmq
import zmq.asyncio

from tokenmill.cluster.kv_index import KVIndex
from tokenmill.engine.kv_events import AllBlocksCleared, EventBatch, decode_batch
from tokenmill.engine.protocol import secure_socket, worker_secret

log = logging.getLogger(__name__)
REPLAY_TIMEOUT_S = 2.0


@dataclass
class SubscriberStats:
    batches: int = 0
    gaps: int = 0  # jumps in the sequence seen on the live stream
    replayed: int = 0  # batches recovered by replay
    lost: int = 0  # gaps replay could not fill (the worker's index was dropped)


class KVEventSubscriber:
    def __init__(
        self,
        ctx: zmq.asyncio.Context,
        slot: int,
        endpoint: str,
        replay_endpoint: str | None,
        topic: str,
        index: KVIndex,
    ) -> None:
        self.ctx, self.slot, self.index = ctx, slot, index
        self.endpoint, self.replay_endpoint, self.topic = endpoint, replay_endpoint, topic.encode()
        self.last_seq = -1
        self.stats = SubscriberStats()
        self._task: asyncio.Task | None = None
        self._want_replay: int | None = None  # where a gap seen on the live stream begins
        self.synced = asyncio.Event()  # set once the first replay (or its absence) is done

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._run())

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):  # it is being stopped
                await self._task

    async def _run(self) -> None:
        sub = self.ctx.socket(zmq.SUB)
        sub.setsockopt(zmq.SUBSCRIBE, self.topic)
        sub.setsockopt(zmq.LINGER, 0)
        secure_socket(sub, worker_secret(), self.endpoint, server=False)  # the workers' CURVE, if any
        sub.connect(self.endpoint)
        try:
            await self._replay(0)
            self.synced.set()
            while True:
                frames = await sub.recv_multipart()
                if len(frames) != 3:
                    continue
                self._on_message(int.from_bytes(frames[1], "big", signed=True), frames[2])
                if self._want_replay is not None:
                    start, self._want_replay = self._want_replay, None
                    await self._replay(start)
        finally:
            sub.close(linger=0)

    def _on_message(self, seq: int, payload: bytes) -> None:
        if seq <= self.last_seq:
            return  # already applied (a replay brought it in first)
        if seq > self.last_seq + 1:
            self.stats.gaps += 1
            self._want_replay = self.last_seq + 1  # this batch is in the replay too
            return
        self._apply(seq, payload)

    def _decode(self, payload: bytes) -> EventBatch | None:
        try:
            return decode_batch(payload)
        except (msgspec.DecodeError, msgspec.ValidationError, ValueError, IndexError, TypeError) as e:
            log.warning("worker %d sent a KV-event batch that does not decode: %s", self.slot, e)
            return None

    def _apply(self, seq: int, payload: bytes) -> None:
        self._apply_batch(seq, self._decode(payload))

    def _apply_batch(self, seq: int, batch: EventBatch | None) -> None:
        if batch is not None:
            self.index.apply(self.slot, batch.events)
            self.stats.batches += 1
        self.last_seq = seq

    async def _replay(self, start: int) -> None:
        if self.replay_endpoint is None:
            if start > 0:
                self._lose(start)
            return
        dealer = self.ctx.socket(zmq.DEALER)
        dealer.setsockopt(zmq.LINGER, 0)
        secure_socket(dealer, worker_secret(), self.replay_endpoint, server=False)
        dealer.connect(self.replay_endpoint)
        try:
            await dealer.send_multipart([b"", start.to_bytes(8, "big")])
            first = True
            while True:
                if not await dealer.poll(int(REPLAY_TIMEOUT_S * 1000)):
                    log.warning("worker %d did not answer a KV-event replay request", self.slot)
                    if start > 0:
                        self._lose(start)
                    return
                frames = (await dealer.recv_multipart())[1:]  # drop the empty delimiter
                seq_b, payload = frames[-2], frames[-1]  # [topic,] seq, payload
                seq = int.from_bytes(seq_b, "big", signed=True)
                if seq == -1 or not payload:
                    return
                batch = self._decode(payload)
                # A whole state (it begins by clearing the worker's blocks) replaces what was missed.
                whole = (
                    batch is not None and bool(batch.events) and isinstance(batch.events[0], AllBlocksCleared)
                )
                if first and seq > start and start > 0 and not whole:
                    self._lose(start)  # the worker no longer keeps what we missed
                first = False
                if seq > self.last_seq:
                    self._apply_batch(seq, batch)
                    self.stats.replayed += 1
        finally:
            dealer.close(linger=0)

    def _lose(self, start: int) -> None:
        log.warning(
            "worker %d: KV events from %d are lost; its index is rebuilt from now on", self.slot, start
        )
        self.stats.lost += 1
        self.index.remove_worker(self.slot)
