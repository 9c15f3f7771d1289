"""Executors drive the workers of one engine: one in this process, or one process per rank.

The engine talks only to an executor: it sizes the KV pool from the workers' block costs, then hands
each step (plain data) to `execute_model` and gets the sampling rank's output back.
"""

from __future__ import annotations

from abc import ABC, abstractmethod

from tokenmill.config import EngineConfig
from tokenmill.worker.kv_spec import KVCacheSpec
from tokenmill.worker.step import ModelRunnerOutput, SchedulerOutput


class WorkerDiedError(RuntimeError):
    """A worker process is gone: the engine cannot run another step."""


class Executor(ABC):
    @abstractmethod
    def describe(self) -> dict:
        """What the workers loaded: model_config (a dict), max_model_len, source, load_seconds."""

    @abstractmethod
    def kv_cache_specs(self, block_size: int) -> list[KVCacheSpec]:
        """Each worker's KV block: the pool is sized so the costliest one fits its share."""

    @abstractmethod
    def allocate_kv_cache(self, num_blocks: int, block_size: int) -> None: ...

    @abstractmethod
    def execute_model(self, out: SchedulerOutput) -> ModelRunnerOutput: ...

    @abstractmethod
    def init_kv_connector(
        self, names: list[str], rank_block_bytes: list[int], secrets: dict[str, bytes]
    ) -> list[dict[str, dict]]:
        """Build the worker side of the KV connectors `names` on every rank (after allocate_kv_cache);
        each rank's facts for the scheduler side, {connector name: facts}, in rank order."""

    def compute_threads(self) -> tuple[int, int]:
        """Threads the forward passes use now and the governor's changes since start; (0, 0) where
        the executor does not report them."""
        return 0, 0

    def shutdown(self) -> None:
        return None


class UniProcExecutor(Executor):
    """The default: one worker, in the engine's own process, called directly (no copies, no pickling)."""

    def __init__(self, config: EngineConfig) -> None:
        from tokenmill.worker.worker import Worker  # torch and the model: only when a worker is wanted

        self.worker = Worker(config)

    def describe(self) -> dict:
        return self.worker.describe()

    def kv_cache_specs(self, block_size: int) -> list[KVCacheSpec]:
        return [self.worker.kv_cache_spec(block_size)]

    def allocate_kv_cache(self, num_blocks: int, block_size: int) -> None:
        self.worker.allocate_kv_cache(num_blocks, block_size)

    def execute_model(self, out: SchedulerOutput) -> ModelRunnerOutput:
        return self.worker.execute_model(out)

    def init_kv_connector(
        self, names: list[str], rank_block_bytes: list[int], secrets: dict[str, bytes]
    ) -> list[dict[str, dict]]:
        return [self.worker.init_kv_connector(names, rank_block_bytes, secrets)]

    def compute_threads(self) -> tuple[int, int]:
        return self.worker.compute_threads()

    def shutdown(self) -> None:
        self.worker.shutdown()


def make_executor(config: EngineConfig) -> Executor:
    p = config.parallel
    kind = p.executor
    if kind == "auto":
        kind = "mp" if p.world_size > 1 else "uni"
    if kind == "uni":
        if p.world_size > 1:
            raise ValueError("executor 'uni' runs one worker; tensor/pipeline parallelism needs 'mp'")
        return UniProcExecutor(config)
    if kind == "mp":
        from tokenmill.worker.multiproc_executor import MultiprocExecutor

        return MultiprocExecutor(config)
    raise ValueError(f"unknown executor {p.executor!r}; available: auto, uni, mp")
