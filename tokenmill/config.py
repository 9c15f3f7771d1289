"""Configuration of the engine, one dataclass per layer, built once and passed down."""

from __future__ import annotations

from dataclasses import dataclass, field

from tokenmill.weights.catalog import DEFAULT_MODEL


@dataclass
class SchedulerConfig:
    max_num_batched_tokens: int = 2048  # token budget of one step (prefill chunks + decode tokens)
    max_num_seqs: int = 256  # requests running at once
    policy: str = "fcfs"  # or "priority": lower `priority` values first, preempted last
    long_prefill_token_threshold: int | None = None  # cap one request's tokens per step


@dataclass
class CacheConfig:
    block_size: int = 16  # tokens per KV block
    kv_cache_memory_gb: float = 1.0  # the pool is preallocated from this budget
    num_blocks: int | None = None  # overrides the memory budget (tests)
    enable_prefix_caching: bool = True


@dataclass
class ParallelConfig:
    tensor_parallel_size: int = 1  # ranks that split each layer (heads, MLP columns, vocabulary)
    pipeline_parallel_size: int = 1  # ranks that each run a run of layers, one after the other
    # "uni": one worker in the engine process; "mp": one process per rank; "auto": "mp" when there is
    # more than one rank.
    executor: str = "auto"

    @property
    def world_size(self) -> int:
        return self.tensor_parallel_size * self.pipeline_parallel_size


@dataclass
class EngineConfig:
    model: str = DEFAULT_MODEL
    dtype: str = "bfloat16"  # or "float32" (or "float16" where the device supports it well)
    device: str = "cpu"
    max_model_len: int | None = None  # default: the model's context length, capped at 8192
    num_threads: int | None = None  # torch intra-op threads; None leaves torch's default
    # Fewer threads while other processes crowd the cores, all of them again once the machine is
    # quiet (worker/thread_governor.py): a busy neighbour costs its share, not a 70x stall.
    adaptive_threads: bool = True
    # "torch": plain-PyTorch reference everywhere; "cpu": tokenmill's C++ kernels (paged decode attention,
    # fused norm/rope/silu) at the best instruction-set level this CPU runs; a level name ("avx2",
    # "avx512", "avx512_bf16"): that build, to test the path another CPU takes; "auto": the C++ kernels
    # on a CPU if they build and run here, else the reference with a one-line warning.
    kernels: str = "auto"
    # None: weights in `dtype`. "int4": weight-only 4-bit (groups of 32) for decode-sized batches, the
    # precision of a Q4_0/Q4_1 GGUF file; larger batches use the dtype copy.
    quantization: str | None = None
    cache_dir: str | None = None  # where dequantized GGUF weights are cached
    seed: int = 0  # for requests without their own seed
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    cache: CacheConfig = field(default_factory=CacheConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
