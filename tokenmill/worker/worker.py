"""A worker: one device, its part of the model (whole, or a tensor/pipeline-parallel shard), its part
of the KV cache, and the steps it runs.

The engine asks every worker how many bytes a KV block costs it and sizes one pool that fits the
smallest; each worker then allocates its share (its layers and key/value heads) of those blocks.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path

import torch

from tokenmill.config import EngineConfig
from tokenmill.lora.model import LoRAModel
from tokenmill.models import registry
from tokenmill.models.config import ModelConfig
from tokenmill.models.parallel import Shard
from tokenmill.models.quant import QuantConfig
from tokenmill.models.quant.arithmetic import announce, float32_arithmetic
from tokenmill.models.quant.method import linear_kernels
from tokenmill.models.smoothing import Calibration, calibration_chunks
from tokenmill.weights import catalog
from tokenmill.weights.cache_inventory import note_source
from tokenmill.weights.cache_paths import weights_cache_root
from tokenmill.worker.allocator import keep_freed_memory, release_freed_memory
from tokenmill.worker.grammars import RequestGrammars
from tokenmill.worker.kv_connector import (
    KVConnectorWorker,
    KVWorkerContext,
    build_worker_connector,
    describe_by_name,
    shares_kv_cache,
)
from tokenmill.worker.kv_offload.tiers import layout_namespace, shard_label
from tokenmill.worker.kv_spec import KVCacheSpec
from tokenmill.worker.kv_transfer.transfer_engine import shared_kv_tensor
from tokenmill.worker.model_runner import ModelRunner
from tokenmill.worker.parallel_state import ParallelState
from tokenmill.worker.spec_decode.draft_model import DraftModelProposer, check_draft_vocabulary
from tokenmill.worker.spec_decode.speculator import make_speculator
from tokenmill.worker.step import ModelRunnerOutput, SchedulerOutput
from tokenmill.worker.thread_governor import make_governor

log = logging.getLogger(__name__)

DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32, "float16": torch.float16}
DEFAULT_MAX_MODEL_LEN = 8192


def resolve_dtype(name: str) -> torch.dtype:
    if name not in DTYPES:
        raise ValueError(f"dtype must be auto or one of {', '.join(DTYPES)}, got {name!r}")
    return DTYPES[name]


def resolve_max_model_len(config: EngineConfig, mc: ModelConfig) -> int:
    return config.max_model_len or min(mc.max_position_embeddings, DEFAULT_MAX_MODEL_LEN)


class Worker:
    def __init__(self, config: EngineConfig, parallel: ParallelState | None = None) -> None:
        self.config = config
        self.parallel = ps = parallel or ParallelState.single()
        if config.num_threads:
            torch.set_num_threads(config.num_threads)
        self.governor = make_governor(config.adaptive_threads)
        self.device = torch.device(config.device)
        # dtype "auto": bf16 weights, computed in float32 on a CPU without BF16 instructions, the linears'
        # weights kept in bf16 (models/wide_linear.py); self.dtype is the arithmetic's (activations, KV
        # cache), weights_dtype the checkpoint's as loaded.
        auto = config.dtype == "auto"
        self.weights_dtype = weights_dtype = resolve_dtype("bfloat16" if auto else config.dtype)
        self.bf16_weights = auto and float32_arithmetic(
            weights_dtype, self.device, config.kernels, config.quantization
        )
        self.dtype = torch.float32 if self.bf16_weights else weights_dtype
        if self.bf16_weights:
            announce(config.kernels)
        if self.device.type == "cpu":
            keep_freed_memory()  # activations re-used, not re-faulted each step (worker/allocator.py)
        t0 = time.perf_counter()
        path = catalog.resolve(config.model)
        cache_dir = Path(config.cache_dir) if config.cache_dir else None
        loaded = registry.load_checkpoint(path, weights_dtype, cache_dir)
        self.model_config: ModelConfig = loaded.config
        self.tokenizer = loaded.tokenizer
        self.source = path
        self.max_model_len = resolve_max_model_len(config, self.model_config)
        self.shard = Shard.of(
            self.model_config, ps.tp_size, ps.tp_rank, ps.pp_size, ps.pp_rank,
            expert_parallel=config.parallel.enable_expert_parallel,
        )  # fmt: skip
        self.model = registry.build(
            self.model_config,
            loaded.state_dict,
            self.dtype,
            self.device,
            self.max_model_len,
            config.kernels,
            QuantConfig(
                config.quantization,
                int4_activations=config.int4_activations,
                int8_scales=config.int8_scales,
                calibration=self._calibration(config),
                smoothing_alpha=config.int8_smoothing,
                bf16_weights=self.bf16_weights,
                codes=loaded.codes,
            ),
            shard=self.shard,
            comm=ps,
        )
        del loaded
        self.lora: LoRAModel | None = None
        if config.lora.enable_lora:
            lc = config.lora
            self.lora = LoRAModel(
                self.model, self.model_config, self.shard, lc.max_loras, lc.max_lora_rank, self.dtype,
                self.device,
            )  # fmt: skip
        kernels = ", ".join(f"{n} {k}" for k, n in linear_kernels(self.model).items())
        log.info("weights %s, arithmetic %s: linears on %s", self._weights_label() or self.dtype_name,
                 str(self.dtype).removeprefix("torch."), kernels)  # fmt: skip
        # int8's calibration may have made the folder of a Hugging Face directory just now.
        note_source(weights_cache_root(path, cache_dir), path)
        if self.device.type == "cpu":
            release_freed_memory()  # the load's transients (worker/allocator.py)
        self.runner: ModelRunner | None = None
        self.load_seconds = time.perf_counter() - t0

    def _calibration(self, config: EngineConfig) -> Calibration | None:
        """What int8's smoothing calibrates on (models/smoothing.py), when it is asked for (models/quant
        decides whether this model can be smoothed), with the maxima kept beside the weights' cache."""
        if config.quantization != "int8" or not config.int8_smoothing:
            return None
        tokenizer, cache_dir = self.tokenizer, Path(config.cache_dir) if config.cache_dir else None
        return Calibration(
            lambda: calibration_chunks(tokenizer.encode_text), weights_cache_root(self.source, cache_dir)
        )

    def _weights_label(self) -> str | None:
        """The weight precision as far as it changes the keys and values: the quantization, and for
        int8 its group form or the smoothing strength it was smoothed with."""
        label = self.model.quant.label()  # models/quant: its form, int8 activations, smoothing
        if self.bf16_weights:  # float32 activations: other keys and values than bf16 arithmetic's
            return f"{label or 'bf16-weights'}-f32"
        return label

    def kv_cache_spec(self, block_size: int) -> KVCacheSpec:
        """What one KV block of `block_size` tokens is for this worker (its layers, its kv heads)."""
        return KVCacheSpec(
            block_size=block_size,
            num_layers=self.model.num_local_layers,
            num_kv_heads=len(self.shard.kv_heads),
            head_dim=self.model_config.head_dim,
            dtype_bytes=torch.empty(0, dtype=self.dtype).element_size(),
            kv_format=self.config.cache.kv_format,
        )

    def allocate_kv_cache(self, num_blocks: int, block_size: int) -> None:
        kv_caches, self.shm_path = None, None
        self.kv_connector: KVConnectorWorker | None = None
        self.kv_spec = spec = self.kv_cache_spec(block_size)
        if shares_kv_cache(self.config) and self.device.type == "cpu":
            kv_caches, self.shm_path = shared_kv_tensor(
                spec.tensor_shape(num_blocks), spec.storage_dtype(self.dtype)
            )
        self.runner = ModelRunner(
            self.model,
            spec,
            num_blocks,
            self.dtype,
            self.device,
            self.config.kernels,
            self.config.seed,
            self.parallel,
            make_speculator(self.config.speculative, self._draft_proposer(num_blocks, block_size)),
            RequestGrammars(
                self.tokenizer, self.model_config.vocab_size, self.config.speculative.num_speculative_tokens
            ),
            kv_caches,
        )

    def init_kv_connector(
        self, names: list[str], rank_block_bytes: list[int], secrets: dict[str, bytes]
    ) -> dict[str, dict]:
        """The worker side of the KV connectors `names` (the engine's choice, worker/kv_connector.py's
        registry), over this rank's cache; what the scheduler side needs of each."""
        assert self.runner is not None, "allocate_kv_cache first"
        ps, spec = self.parallel, self.kv_spec
        parallel = ps.tp_size * ps.pp_size > 1
        shard = (
            shard_label(self.shard.layers, self.shard.kv_heads, ps.tp_size, ps.pp_size) if parallel else None
        )
        namespace = layout_namespace(
            Path(self.source).name, self.dtype_name, self._weights_label(), spec, ps.rank, shard
        )
        ctx = KVWorkerContext(
            self.config, self.runner.kv_caches, spec, ps.rank, ps.tp_size, ps.pp_size, rank_block_bytes,
            namespace, self.shm_path, secrets,
        )  # fmt: skip
        self.kv_connector = build_worker_connector(names, ctx)
        return describe_by_name(names, self.kv_connector.describe()) if self.kv_connector else {}

    def _draft_proposer(self, num_blocks: int, block_size: int) -> DraftModelProposer | None:
        """The draft model of `--speculative draft:MODEL`, on the rank that samples, with a KV pool of
        as many blocks as the target's, in the target's KV format (a self-draft's blocks are then the
        same size as the target's, 4-bit weights or not)."""
        spec = self.config.speculative
        name = spec.draft_model
        if name is None or not self.parallel.samples:
            return None
        t0 = time.perf_counter()
        path = self.source if name == "self" else catalog.resolve(name)
        cache_dir = Path(self.config.cache_dir) if self.config.cache_dir else None
        loaded = registry.load_checkpoint(path, self.weights_dtype, cache_dir)
        bf16_weights = self.config.dtype == "auto" and float32_arithmetic(
            self.weights_dtype, self.device, self.config.kernels, spec.draft_quantization
        )
        check_draft_vocabulary(self.tokenizer, loaded.tokenizer, name)
        model = registry.build(
            loaded.config,
            loaded.state_dict,
            self.dtype,
            self.device,
            self.max_model_len,
            self.config.kernels,
            QuantConfig(spec.draft_quantization, bf16_weights=bf16_weights, codes=loaded.codes),
        )
        del loaded
        if self.device.type == "cpu":
            release_freed_memory()
        log.info("draft model %s (%s) loaded in %.1fs", name, spec.draft_quantization or self.dtype_name,
                 time.perf_counter() - t0)  # fmt: skip
        return DraftModelProposer(
            model, num_blocks, block_size, self.dtype, self.device, self.config.kernels, self.max_model_len,
            self.config.cache.kv_format,
        )  # fmt: skip

    def execute_model(self, out: SchedulerOutput) -> ModelRunnerOutput:
        assert self.runner is not None, "allocate_kv_cache first"
        conn = self.kv_connector
        if conn is not None and out.kv_connector_metadata is not None:
            conn.apply(out.kv_connector_metadata)  # before the forward pass overwrites any block
        result = self.runner.execute(out)
        if conn is not None:
            # A step with nothing to compute is the engine waiting for loads: wait a little for one.
            result.kv_connector_output = conn.after_step(0.005 if not out.num_scheduled_tokens else 0.0)
        if self.governor is not None:
            self.governor.tick()
        return result

    def shutdown(self) -> None:
        conn = getattr(self, "kv_connector", None)
        if conn is not None:
            conn.close()

    def compute_threads(self) -> tuple[int, int]:
        """Torch's intra-op threads now, and the thread governor's changes since start."""
        return torch.get_num_threads(), self.governor.changes if self.governor is not None else 0

    def describe(self) -> dict:
        """Plain facts the engine needs from its workers (the same on every rank)."""
        return {
            "model_config": self.model_config.to_dict(),
            "max_model_len": self.max_model_len,
            "source": str(self.source),
            "load_seconds": self.load_seconds,
            # The offload namespace's weights part, which the scheduler's connector must name as the
            # workers do (smoothing and int8 activations are decided at load, not by the config alone).
            "weights_label": self._weights_label(),
            "dtype": self.dtype_name,
        }

    @property
    def dtype_name(self) -> str:
        """The weights' dtype as the config names it ("auto" resolved), for the offload namespace."""
        return str(self.weights_dtype).removeprefix("torch.")
