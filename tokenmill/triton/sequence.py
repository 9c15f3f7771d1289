"""The sequence batcher: requests that share a correlation ID go, in order, to the same instance.

A sequence is pinned to an instance when its START request arrives (the instance with the fewest
live sequences) and released after its END request, or after max_sequence_idle_microseconds without
a request (default 1 s, as Triton). Each execution batches at most one request per sequence (the
oldest of each), up to max_batch_size of them (direct) or max_candidate_sequences (oldest), waiting up
to the strategy's max_queue_delay_microseconds for more. The model sees the configured control
inputs: START, END, READY (1 for every request of the batch) and CORRID, one value per request.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections import deque
from dataclasses import dataclass, field

import numpy as np

from tokenmill.triton.backends import InferRequest, Instance, Outputs
from tokenmill.triton.config import TritonModelConfig
from tokenmill.triton.dtypes import CONFIG_TO_PROTOCOL, NUMPY
from tokenmill.triton.pb_utils import (
    TRITONSERVER_REQUEST_FLAG_SEQUENCE_END,
    TRITONSERVER_REQUEST_FLAG_SEQUENCE_START,
)
from tokenmill.triton.scheduling import BatchScheduler, InferError, Pending
from tokenmill.triton.stats import ModelStats


@dataclass
class _Sequence:
    instance: int
    queue: deque[Pending] = field(default_factory=deque)
    busy: bool = False
    last_ns: int = field(default_factory=time.perf_counter_ns)
    ended: bool = False


class SequenceBatcher(BatchScheduler):
    def __init__(self, cfg: TritonModelConfig, instances: list[Instance], stats: ModelStats) -> None:
        super().__init__(cfg, instances, stats)
        sb = cfg.sequence_batching or {}
        strategy = sb.get("oldest") if "oldest" in sb else sb.get("direct", {})
        self.oldest = "oldest" in sb
        self.delay_ns = int((strategy or {}).get("max_queue_delay_microseconds", 0)) * 1000
        width = max(1, cfg.max_batch_size)
        self.width = min(width, int(strategy.get("max_candidate_sequences", width))) if self.oldest else width
        self.idle_ns = int(sb.get("max_sequence_idle_microseconds", 0) or 1_000_000) * 1000
        self.controls = self._controls(sb.get("control_input", []))
        self.sequences: dict[int | str, _Sequence] = {}
        self.wake = [asyncio.Event() for _ in instances]
        loop = asyncio.get_running_loop()
        self.tasks = [loop.create_task(self._dispatch(i)) for i in range(len(instances))]
        self.tasks.append(loop.create_task(self._reap_idle()))

    def _controls(self, specs: list[dict]) -> list[tuple[str, str, tuple]]:
        """(input name, kind, (false value, true value) or dtype) for each control input."""
        out = []
        for ci in specs:
            for c in ci.get("control", []):
                kind = c["kind"]
                if kind == "CONTROL_SEQUENCE_CORRID":
                    dt = NUMPY[CONFIG_TO_PROTOCOL[c.get("data_type", "TYPE_UINT64")]]
                    out.append((ci["name"], kind, (dt,)))
                elif c.get("int32_false_true"):
                    out.append((ci["name"], kind, tuple(np.int32(v) for v in c["int32_false_true"])))
                elif c.get("fp32_false_true"):
                    out.append((ci["name"], kind, tuple(np.float32(v) for v in c["fp32_false_true"])))
                elif c.get("bool_false_true"):
                    out.append((ci["name"], kind, tuple(np.bool_(v) for v in c["bool_false_true"])))
                else:
                    out.append((ci["name"], kind, (np.int32(0), np.int32(1))))
        return out

    async def submit(self, req: InferRequest) -> Outputs:
        cid = req.correlation_id
        if cid in (0, "", None):
            raise InferError(
                400,
                f"inference request to model {self.cfg.name!r} must specify a non-zero or "
                "non-empty correlation ID (sequence_id)",
            )
        self._check_correlation_id(cid)
        start = bool(req.flags & TRITONSERVER_REQUEST_FLAG_SEQUENCE_START)
        seq = self.sequences.get(cid)
        if start and (seq is None or seq.ended or not seq.queue):
            load = [0] * len(self.instances)
            for s in self.sequences.values():
                load[s.instance] += 1
            seq = _Sequence(instance=load.index(min(load)))
            self.sequences[cid] = seq
        elif seq is None:
            raise InferError(
                400,
                f"inference request for sequence {cid} to model {self.cfg.name!r} must specify "
                "the START flag on the first request of the sequence",
            )
        p = Pending(req, req.batch_size(self.cfg), asyncio.get_running_loop().create_future())
        seq.queue.append(p)
        seq.last_ns = p.t_arrival
        if req.flags & TRITONSERVER_REQUEST_FLAG_SEQUENCE_END:
            seq.ended = True
        self.stats.enqueued()
        self.wake[seq.instance].set()
        return await p.future

    def _check_correlation_id(self, cid: object) -> None:
        """A sequence_id the model's CORRID control input can carry, refused here with a 400: found
        only when its batch is formed, it used to stop that instance's dispatcher, and every later
        request to the instance waited forever."""
        if isinstance(cid, bool) or not isinstance(cid, int | str):
            raise InferError(400, f"sequence_id must be an integer or a string, not {type(cid).__name__}")
        for name, kind, values in self.controls:
            if kind != "CONTROL_SEQUENCE_CORRID" or values[0] == np.object_:
                continue  # a TYPE_STRING CORRID takes either kind of ID (an integer as its digits)
            dt = np.dtype(values[0])
            if isinstance(cid, str):
                raise InferError(
                    400,
                    f"model {self.cfg.name!r} takes integer sequence IDs (its CORRID control input "
                    f"{name!r} is {dt.name}), not the string sequence_id {cid[:64]!r}",
                )
            if dt.kind in "iu" and not np.iinfo(dt).min <= cid <= np.iinfo(dt).max:
                raise InferError(
                    400,
                    f"sequence_id {cid} does not fit the {dt.name} CORRID control input of model "
                    f"{self.cfg.name!r}",
                )

    def _ready(self, idx: int) -> list[tuple[int | str, _Sequence]]:
        ready = [(c, s) for c, s in self.sequences.items() if s.instance == idx and s.queue and not s.busy]
        return sorted(ready, key=lambda cs: cs[1].queue[0].t_arrival)

    async def _dispatch(self, idx: int) -> None:
        while True:
            ready = self._ready(idx)
            if not ready:
                self.wake[idx].clear()
                await self.wake[idx].wait()
                continue
            if len(ready) < self.width and self.delay_ns:
                waited = time.perf_counter_ns() - ready[0][1].queue[0].t_arrival
                if waited < self.delay_ns:
                    self.wake[idx].clear()
                    with contextlib.suppress(TimeoutError):
                        await asyncio.wait_for(self.wake[idx].wait(), (self.delay_ns - waited) / 1e9)
                    continue
            chosen = ready[: self.width]
            batch = []
            for cid, s in chosen:
                p = s.queue.popleft()
                s.busy = True
                try:
                    self._add_controls(p.req, cid)
                except Exception as e:  # this request fails; the dispatcher must go on for the others
                    if not p.future.done():
                        p.future.set_exception(InferError(400, f"sequence {cid!r}: {e}"))
                    continue
                batch.append(p)
            if batch:
                await self.run_batch(idx, batch)
            for cid, s in chosen:
                s.busy = False
                s.last_ns = time.perf_counter_ns()
                if s.ended and not s.queue and self.sequences.get(cid) is s:
                    del self.sequences[cid]

    def _add_controls(self, req: InferRequest, cid: int | str) -> None:
        shape = (1,)
        for name, kind, values in self.controls:
            if kind == "CONTROL_SEQUENCE_CORRID":
                dt = values[0]
                v = np.array([cid if dt != np.object_ else str(cid).encode()], dtype=dt)
            else:
                flag = {
                    "CONTROL_SEQUENCE_START": TRITONSERVER_REQUEST_FLAG_SEQUENCE_START,
                    "CONTROL_SEQUENCE_END": TRITONSERVER_REQUEST_FLAG_SEQUENCE_END,
                }.get(kind)
                on = True if kind == "CONTROL_SEQUENCE_READY" else bool(req.flags & flag)
                v = np.array([values[1] if on else values[0]])
            req.inputs[name] = v.reshape(shape)

    async def _reap_idle(self) -> None:
        while True:
            await asyncio.sleep(min(self.idle_ns / 1e9, 1.0))
            now = time.perf_counter_ns()
            for cid, s in list(self.sequences.items()):
                if not s.queue and not s.busy and now - s.last_ns > self.idle_ns:
                    del self.sequences[cid]

    async def close(self) -> None:
        for t in self.tasks:
            t.cancel()
        for s in self.sequences.values():
            for p in s.queue:
                if not p.future.done():
                    p.future.set_exception(InferError(503, f"model {self.cfg.name!r} was unloaded"))
        await super().close()
