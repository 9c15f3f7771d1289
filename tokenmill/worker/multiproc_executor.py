"""One worker process per rank, joined by torch.distributed (gloo on CPU, nccl on CUDA).

Ranks are started as fresh interpreters (`python -m tokenmill.worker.multiproc_executor`), not by
multiprocessing's spawn, which re-runs the parent's main script and so would demand an
`if __name__ == "__main__"` guard of every script that builds an `LLM`. Each rank connects back to the
executor (an authenticated local socket) and is handed its configuration there.

Every rank gets every step (plain data, pickled over a pipe) and runs its part; the sampling rank (the
last stage's first tensor-parallel rank) sends its output back, and the others only what their KV
connectors report (each moves its own part of every block), which the executor joins into the
sampling rank's output (worker/kv_connector.py's RankCombiner). A step that fails on one rank
still takes the others' connector reports (what they finished is gone from their connectors once
reported): they go out with the next step's output. A rank that dies, or a step that outlives the
collective timeout, ends the engine with WorkerDiedError rather than a hang.

At shutdown every rank closes its KV connectors and says so before the executor stops it: a rank
whose offload tiers still write queued blocks gets up to the registry's FLUSH_TIMEOUT_S for them.
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
from tokenmill.worker.kv_connector import RankCombiner, close_timeout_s, merge_outputs
from tokenmill.worker.kv_spec import KVCacheSpec
from tokenmill.worker.lifetime import die_with_parent, ignore_interrupts, interrupts_held
from tokenmill.worker.step import KVConnectorOutput, ModelRunnerOutput, SchedulerOutput

log = logging.getLogger(__name__)
COLLECTIVE_TIMEOUT_S = 300
AUTHKEY_ENV = "TOKENMILL_RANK_AUTHKEY"  # a collective waits this long for a slow or dead peer, then fails
EXIT_GRACE_S = 5.0  # how long a rank that was told to stop (and has nothing to flush) gets to exit


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
            try:
                worker.shutdown()  # its KV connectors finish queued writes, so a restart finds them
            finally:
                with contextlib.suppress(OSError, ValueError):
                    conn.send(("ok", None))  # the executor waits for this before it stops anyone
            return
        try:
            result: Any = getattr(worker, method)(*args)
            if method == "execute_model" and not ps.samples:
                result = result.kv_connector_output  # of the others, only what their connectors say
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
        self.kv_ranks = RankCombiner(world)
        # What the connectors of a failed step's healthy ranks reported: out with the next step's output.
        self._kv_carry: KVConnectorOutput | None = None
        # How long a rank may take to close its KV connectors at shutdown (queued writes finishing), once
        # they are built.
        self.close_timeout_s = 0.0
        self.config = config
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
        results, errors = self._gather_all(timeout)
        if errors:
            raise RuntimeError("; ".join(errors))
        return results

    def _gather_all(self, timeout: float | None = None) -> tuple[list[Any], list[str]]:
        """Every rank's answer, in rank order (None for a rank that failed), and the failures."""
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
                value = None
            results.append(value)
        return results, errors

    def _send(self, method: str, *args: Any) -> None:
        for rank, conn in enumerate(self.conns):
            try:
                conn.send((method, args))
            except (BrokenPipeError, OSError):
                raise WorkerDiedError(f"rank {rank} is gone") from None

    def _call(self, method: str, *args: Any) -> list[Any]:
        self._send(method, *args)
        return self._gather()

    def describe(self) -> dict:
        return self.info

    def kv_cache_specs(self, block_size: int) -> list[KVCacheSpec]:
        return self._call("kv_cache_spec", block_size)

    def allocate_kv_cache(self, num_blocks: int, block_size: int) -> None:
        self._call("allocate_kv_cache", num_blocks, block_size)

    def init_kv_connector(
        self, names: list[str], rank_block_bytes: list[int], secrets: dict[str, bytes]
    ) -> list[dict[str, dict]]:
        infos = self._call("init_kv_connector", names, rank_block_bytes, secrets)
        self.close_timeout_s = close_timeout_s(self.config)
        return infos

    def execute_model(self, out: SchedulerOutput) -> ModelRunnerOutput:
        self._send("execute_model", out)
        results, errors = self._gather_all()
        # Every rank that ran the step took its connectors' reports (loads and sends finished, tier
        # events): they are joined even when another rank failed, or a load some rank finished would
        # never be reported by all and its request would wait for it forever.
        reports = [r.kv_connector_output if isinstance(r, ModelRunnerOutput) else r for r in results]
        kvo = merge_outputs(self._kv_carry, self.kv_ranks.combine(reports))
        self._kv_carry = None
        if errors:
            self._kv_carry = kvo  # out with the next step's output (the engine goes on after a failure)
            raise RuntimeError("; ".join(errors))
        result: ModelRunnerOutput = results[self.sampler_rank]
        result.kv_connector_output = kvo
        return result

    def shutdown(self) -> None:
        for conn in self.conns:
            with contextlib.suppress(Exception):
                conn.send(("shutdown", ()))
        # Each rank says when its KV connectors are closed (their queued writes are in the file tiers):
        # it is stopped only after that, or after the time they may take, so no rank loses its part.
        # (A rank that died leaves the others of a step stuck in a collective: then nobody is waited for.)
        deadline = time.monotonic() + EXIT_GRACE_S + getattr(self, "close_timeout_s", 0.0)
        for conn, proc in zip(self.conns, self.procs, strict=False):
            with contextlib.suppress(Exception):
                while proc.poll() is None and time.monotonic() < deadline and not conn.poll(0.2):
                    if any(p.poll() not in (None, 0) for p in self.procs):
                        deadline = time.monotonic()
        deadline = min(deadline, time.monotonic() + EXIT_GRACE_S)
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
