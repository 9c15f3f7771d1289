"""One worker process per rank, joined by torch.distributed (gloo on CPU, nccl on CUDA).

Ranks are started as fresh interpreters (`python -m tokenmill.worker.multiproc_executor`), not by
multiprocessing's spawn, which re-runs the parent's main script and so would demand an
`if __name__ == "__main__"` guard of every script that builds an `LLM`. Each rank connects back to the
executor (an authenticated local socket) and is handed its configuration there.

Every rank gets every step (plain data, pickled over a pipe) and runs its part; only the sampling
rank (the last stage's first tensor-parallel rank) sends an output back. A rank that dies, or a step
that outlives the collective timeout, ends the engine with WorkerDiedError rather than a hang.
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import logging
import os
import secrets
import socket
import subprocess
import sys
import threading
import time
from multiprocessing.connection import Client, Connection, Listener
from typing import Any

from tokenmill.config import EngineConfig
from tokenmill.worker.executor import Executor, WorkerDiedError
from tokenmill.worker.kv_spec import KVCacheSpec
from tokenmill.worker.lifetime import die_with_parent, ignore_interrupts, interrupts_held
from tokenmill.worker.step import ModelRunnerOutput, SchedulerOutput

log = logging.getLogger(__name__)
COLLECTIVE_TIMEOUT_S = 300
AUTHKEY_ENV = "TOKENMILL_RANK_AUTHKEY"  # a collective waits this long for a slow or dead peer, then fails


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rank_main(address: tuple[str, int], rank: int) -> None:
    die_with_parent()
    ignore_interrupts()  # a Ctrl-C is the engine's owner's to act on: it stops the ranks through us
    conn = Client(address, authkey=bytes.fromhex(os.environ.pop(AUTHKEY_ENV)))
    conn.send(("hello", rank))
    config, init_method = conn.recv()
    import torch
    import torch.distributed as dist

    from tokenmill.worker.parallel_state import ParallelState, backend_for
    from tokenmill.worker.worker import Worker

    p = config.parallel
    device = torch.device(config.device)
    dist.init_process_group(
        backend_for(device),
        init_method=init_method,
        rank=rank,
        world_size=p.world_size,
        timeout=datetime.timedelta(seconds=COLLECTIVE_TIMEOUT_S),
    )
    ps = ParallelState.from_initialized(p.tensor_parallel_size, p.pipeline_parallel_size, rank)
    try:
        worker = Worker(config, ps)
    except Exception as e:
        log.exception("rank %d failed to load", rank)
        conn.send(("error", f"rank {rank} failed to load: {e}"))
        return
    conn.send(("ok", worker.describe()))
    while True:
        try:
            method, args = conn.recv()
        except (EOFError, OSError):
            return
        if method == "shutdown":
            return
        try:
            result: Any = getattr(worker, method)(*args)
            if method == "execute_model" and not ps.samples:
                result = None  # only the sampling rank's output is wanted
            conn.send(("ok", result))
        except Exception as e:
            log.exception("rank %d: %s failed", rank, method)
            conn.send(("error", f"rank {rank}: {type(e).__name__}: {e}"))


class MultiprocExecutor(Executor):
    def __init__(self, config: EngineConfig, startup_timeout: float = 600.0) -> None:
        p = config.parallel
        world = p.world_size
        # Each rank gets its share of the cores unless told otherwise; the governor stays off, since
        # ranks that wait for each other at every layer must keep the same pace.
        threads = config.num_threads or max(1, (os.cpu_count() or 1) // world)
        rank_config = dataclasses.replace(config, num_threads=threads, adaptive_threads=False)
        init_method = f"tcp://127.0.0.1:{_free_port()}"
        authkey = secrets.token_bytes(16)
        listener = Listener(("127.0.0.1", 0), authkey=authkey)
        env = {**os.environ, AUTHKEY_ENV: authkey.hex()}
        self.procs: list[subprocess.Popen] = []
        self.conns: list[Connection] = []
        try:
            for rank in range(world):
                cmd = [
                    sys.executable,
                    "-m",
                    __name__,
                    f"{listener.address[0]}:{listener.address[1]}",
                    str(rank),
                ]
                with interrupts_held():  # until the rank takes SIGINT over (ignore_interrupts)
                    self.procs.append(subprocess.Popen(cmd, env=env))
            self.conns = self._accept(listener, world, startup_timeout)
            for conn in self.conns:
                conn.send((rank_config, init_method))
        except BaseException:
            self.shutdown()
            raise
        finally:
            listener.close()
        self.sampler_rank = (p.pipeline_parallel_size - 1) * p.tensor_parallel_size
        try:
            infos = self._gather(startup_timeout)
        except BaseException:
            self.shutdown()
            raise
        self.info = infos[0]

    def _accept(self, listener: Listener, world: int, timeout: float) -> list[Connection]:
        """Each rank's connection, in rank order; fails if a rank exits or the time runs out."""
        conns: dict[int, Connection] = {}
        done = threading.Event()

        def accept() -> None:
            with contextlib.suppress(OSError):
                while len(conns) < world:
                    c = listener.accept()
                    _, rank = c.recv()
                    conns[rank] = c
            done.set()

        threading.Thread(target=accept, daemon=True, name="tokenmill-rank-accept").start()
        deadline = time.monotonic() + timeout
        while not done.wait(0.2):
            for rank, proc in enumerate(self.procs):
                if proc.poll() is not None:
                    raise WorkerDiedError(f"rank {rank} exited with code {proc.returncode} while starting")
            if time.monotonic() > deadline:
                raise WorkerDiedError(f"the ranks did not connect within {timeout:.0f}s")
        return [conns[r] for r in range(world)]

    def _gather(self, timeout: float | None = None) -> list[Any]:
        deadline = None if timeout is None else time.monotonic() + timeout
        results: list[Any] = []
        errors: list[str] = []
        for rank, conn in enumerate(self.conns):
            while not conn.poll(0.2):
                for r, proc in enumerate(self.procs):  # a dead peer leaves this rank waiting
                    if proc.poll() is not None:
                        raise WorkerDiedError(f"rank {r} exited with code {proc.returncode}")
                if deadline is not None and time.monotonic() > deadline:
                    raise WorkerDiedError(f"rank {rank} did not answer within {timeout:.0f}s")
            try:
                status, value = conn.recv()
            except (EOFError, OSError) as e:
                raise WorkerDiedError(f"rank {rank} is gone: {e}") from None
            if status == "error":
                errors.append(value)
            results.append(value)
        if errors:
            raise RuntimeError("; ".join(errors))
        return results

    def _call(self, method: str, *args: Any) -> list[Any]:
        for rank, conn in enumerate(self.conns):
            try:
                conn.send((method, args))
            except (BrokenPipeError, OSError):
                raise WorkerDiedError(f"rank {rank} is gone") from None
        return self._gather()

    def describe(self) -> dict:
        return self.info

    def kv_cache_specs(self, block_size: int) -> list[KVCacheSpec]:
        return self._call("kv_cache_spec", block_size)

    def allocate_kv_cache(self, num_blocks: int, block_size: int) -> None:
        self._call("allocate_kv_cache", num_blocks, block_size)

    def execute_model(self, out: SchedulerOutput) -> ModelRunnerOutput:
        return self._call("execute_model", out)[self.sampler_rank]

    def shutdown(self) -> None:
        for conn in self.conns:
            with contextlib.suppress(Exception):
                conn.send(("shutdown", ()))
        deadline = time.monotonic() + 5
        for proc in self.procs:
            try:
                proc.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        for conn in self.conns:
            conn.close()
        self.procs, self.conns = [], []


if __name__ == "__main__":
    host, port = sys.argv[1].rsplit(":", 1)
    logging.basicConfig(
        level=logging.WARNING, format=f"rank {sys.argv[2]} %(levelname)s %(name)s: %(message)s"
    )
    _rank_main((host, int(port)), int(sys.argv[2]))
