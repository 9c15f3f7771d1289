"""Model warmup (`model_warmup` in config.pbtxt): requests a model runs at load, before it is READY.

Each sample names its inputs with a datatype, dims (without the batch dimension) and where the data
comes from: zeros, random values, or a file under `<model>/warmup/` holding one batch element's raw
row-major bytes (BYTES: each element a 4-byte little-endian length, then its bytes). `batch_size`
copies of that element make the request's batch (batched models); `count` runs of the sample are
made (0, the default, means one). As Triton, every instance runs every sample, and a failed run
fails the load.
"""

from __future__ import annotations

import asyncio
import logging
import zlib
from pathlib import Path

import numpy as np

from tokenmill.triton.backends import InferRequest, ModelError
from tokenmill.triton.config import TritonModelConfig
from tokenmill.triton.decoupled import ResponseStream
from tokenmill.triton.dtypes import CONFIG_TO_PROTOCOL, NUMPY, PROTOCOL_TO_CONFIG, bytes_elements
from tokenmill.triton.pbtxt import ConfigError
from tokenmill.triton.scheduling import BatchScheduler, InferError, Pending
from tokenmill.triton.stats import ModelStats

log = logging.getLogger(__name__)
WARMUP_DIR = "warmup"
Sample = tuple[str, InferRequest, int]  # (sample name, request, times to run it)


def warmup_requests(cfg: TritonModelConfig, model_dir: Path) -> list[Sample]:
    """The model's warmup samples as requests, in config order; ConfigError (a sample that does not
    fit the model's inputs) or ModelError (a data file missing, outside warmup/ or of the wrong size),
    with one line naming the model and the sample."""
    out = []
    for i, sample in enumerate(cfg.warmup):
        name = sample.get("name") or f"#{i + 1}"
        where = f"{cfg.name}: warmup sample {name!r}"
        batch = int(sample.get("batch_size", 1))
        if batch < 1:
            raise ConfigError(f"{where}: batch_size must be at least 1")
        if not cfg.batched and batch != 1:
            raise ConfigError(
                f"{where}: batch_size must be 1 for a model without batching (max_batch_size 0)"
            )
        if cfg.batched and batch > cfg.max_batch_size:
            raise ConfigError(f"{where}: batch_size {batch} exceeds max_batch_size {cfg.max_batch_size}")
        count = int(sample.get("count", 0) or 0)
        if count < 0:
            raise ConfigError(f"{where}: count must not be negative")
        inputs = _inputs(cfg, model_dir, sample, batch, where)
        out.append((name, InferRequest(inputs, request_id=f"warmup:{name}"), max(1, count)))
    return out


def _controls(cfg: TritonModelConfig) -> dict[str, str]:
    """The sequence batcher's control inputs and their datatypes: a warmup sample may set them (the
    batcher fills them in only for requests it schedules itself)."""
    out = {}
    for ci in (cfg.sequence_batching or {}).get("control_input", []):
        for c in ci.get("control", []):
            if c["kind"] == "CONTROL_SEQUENCE_CORRID":
                out[ci["name"]] = CONFIG_TO_PROTOCOL.get(c.get("data_type", "TYPE_UINT64"), "BF16")
            elif c.get("fp32_false_true"):
                out[ci["name"]] = "FP32"
            elif c.get("bool_false_true"):
                out[ci["name"]] = "BOOL"
            else:
                out[ci["name"]] = "INT32"
    return out


def _inputs(
    cfg: TritonModelConfig, model_dir: Path, sample: dict, batch: int, where: str
) -> dict[str, np.ndarray]:
    declared = {t.name: t for t in cfg.inputs}
    controls = _controls(cfg)
    given: dict[str, dict] = {}
    for item in sample.get("inputs", []):
        key = item.get("key", "")
        if key in given:
            raise ConfigError(f"{where}: input {key!r} is given twice")
        given[key] = item.get("value", {})
    unknown = [k for k in given if k not in declared and k not in controls]
    if unknown:
        raise ConfigError(
            f"{where}: {unknown[0]!r} is not an input of the model (inputs: {', '.join(declared) or 'none'})"
        )
    missing = [t.name for t in cfg.inputs if not t.optional and t.name not in given]
    if missing:
        raise ConfigError(f"{where}: required input {', '.join(map(repr, missing))} is missing")
    out = {}
    for key, spec in given.items():
        if key in declared:
            want, dims_decl = declared[key].datatype, declared[key].dims
        else:
            want, dims_decl = controls[key], None
        config_type = spec.get("data_type", "")
        got = CONFIG_TO_PROTOCOL.get(config_type)
        if got is None:
            raise ConfigError(f"{where}: input {key!r} needs a supported data_type, not {config_type!r}")
        if got != want:
            declared_type = PROTOCOL_TO_CONFIG.get(want, want)
            raise ConfigError(
                f"{where}: input {key!r} is {config_type}, but the model declares {declared_type}"
            )
        dims = [int(d) for d in spec.get("dims", [])]
        if any(d < 0 for d in dims):
            raise ConfigError(f"{where}: input {key!r}: dims must be given in full (no -1)")
        if dims_decl is not None and (
            len(dims) != len(dims_decl)
            or any(d != -1 and d != g for d, g in zip(dims_decl, dims, strict=True))
        ):
            raise ConfigError(f"{where}: input {key!r} has dims {dims}, but the model declares {dims_decl}")
        element = _data(model_dir, key, spec, got, dims, where)
        # A control input is one value per request, as the sequence batcher gives it; the model's own
        # inputs get the batch dimension of a batched model.
        if cfg.batched and dims_decl is not None:
            element = np.repeat(element[np.newaxis], batch, axis=0)
        out[key] = element
    return out


def _data(model_dir: Path, key: str, spec: dict, datatype: str, dims: list[int], where: str) -> np.ndarray:
    """One batch element of an input."""
    kinds = [k for k in ("zero_data", "random_data", "input_data_file") if k in spec]
    if len(kinds) != 1 or spec[kinds[0]] is False:
        raise ConfigError(
            f"{where}: input {key!r} needs one of zero_data: true, random_data: true, input_data_file"
        )
    kind, n = kinds[0], int(np.prod(dims)) if dims else 1
    if kind == "input_data_file":
        return _from_file(model_dir, key, spec["input_data_file"], datatype, dims, n, where)
    if datatype == "BYTES":  # as Triton: random strings fall back to zeros, i.e. empty strings
        return np.array([b""] * n, dtype=np.object_).reshape(dims)
    dt = NUMPY[datatype]
    if kind == "zero_data":
        return np.zeros(dims, dtype=dt)
    # Seeded by model, sample and input: a load runs the same data each time.
    rng = np.random.default_rng(zlib.crc32(where.encode() + b"\0" + key.encode()))
    if dt.kind == "f":  # values between 0 and 1: random bits could make NaN or infinity
        return rng.random(dims).astype(dt)
    if dt.kind == "b":
        return rng.integers(0, 2, dims).astype(dt)
    return rng.integers(np.iinfo(dt).min, np.iinfo(dt).max, dims, dtype=dt, endpoint=True)


def _from_file(
    model_dir: Path, key: str, name: str, datatype: str, dims: list[int], n: int, where: str
) -> np.ndarray:
    folder = (model_dir / WARMUP_DIR).resolve()
    path = (folder / name).resolve()
    if not name or not path.is_relative_to(folder):
        raise ModelError(
            f"{where}: input {key!r}: input_data_file {name!r} must be a file inside {WARMUP_DIR}/"
        )
    try:
        blob = path.read_bytes()
    except OSError as e:
        raise ModelError(f"{where}: input {key!r}: cannot read {WARMUP_DIR}/{name}: {e.strerror}") from None
    if datatype == "BYTES":
        try:
            arr = bytes_elements(blob)
        except ValueError as e:
            raise ModelError(f"{where}: input {key!r}: {WARMUP_DIR}/{name}: {e}") from None
        if arr.size != n:
            raise ModelError(
                f"{where}: input {key!r}: {WARMUP_DIR}/{name} holds {arr.size} strings, dims {dims} need {n}"
            )
        return arr.reshape(dims)
    dt = NUMPY[datatype].newbyteorder("<")
    need = n * dt.itemsize
    if len(blob) != need:
        raise ModelError(
            f"{where}: input {key!r}: {WARMUP_DIR}/{name} has {len(blob)} bytes, "
            f"dims {dims} of {datatype} need exactly {need}"
        )
    return np.frombuffer(blob, dtype=dt).astype(NUMPY[datatype]).reshape(dims)


async def run_warmup(cfg: TritonModelConfig, sched: BatchScheduler, samples: list[Sample]) -> None:
    """Run every sample `count` times on every instance, through the scheduler's execution of a batch
    (the instance's thread, its error handling), before the model is READY. Raises ModelError naming
    the sample on the first failure. The runs are not counted in the model's statistics: they are
    not requests anyone sent."""
    if not samples:
        return
    loop = asyncio.get_running_loop()
    counted = sched.stats
    sched.stats = ModelStats(cfg.name, counted.version)
    try:
        for idx in range(len(sched.instances)):
            for name, req, times in samples:
                log.info("%s instance %d: warmup sample %r, %d run(s)", cfg.name, idx, name, times)
                for _ in range(times):
                    error = await _run_once(cfg, sched, idx, req, loop)
                    if error is not None:
                        raise ModelError(f"{cfg.name}: warmup sample {name!r} failed: {error}")
    finally:
        sched.stats = counted


async def _run_once(
    cfg: TritonModelConfig,
    sched: BatchScheduler,
    idx: int,
    req: InferRequest,
    loop: asyncio.AbstractEventLoop,
) -> str | None:
    """One run of a sample on instance idx: None, or what went wrong."""
    # A fresh copy each run: a model may write into its inputs, and the request gathers its times.
    run = InferRequest({k: v.copy() for k, v in req.inputs.items()}, request_id=req.request_id)
    if cfg.decoupled:
        run.stream = ResponseStream(loop)
    p = Pending(run, run.batch_size(cfg), loop.create_future())
    await sched.run_batch(idx, [p])
    try:
        p.future.result()
    except InferError as e:
        return e.message
    if run.stream is not None:
        # As Triton, the run is over when execute() returns; a decoupled model's responses sent until
        # then are in the stream (the loop runs their hand-over before execute()'s completion).
        while not run.stream.queue.empty():
            item = run.stream.queue.get_nowait()
            if item.error is not None:
                return item.error
    return None
