"""The model repository: Triton's layout, model control modes, loading, unloading and routing.

Layout: <repository>/<model>/config.pbtxt and numbered version folders (the newest one served unless
version_policy says otherwise). Control modes as Triton's: `none` loads everything at start and never
changes; `poll` also rescans every poll interval (new, removed and changed models); `explicit` loads
only --load-model names at start, then whatever the repository API asks. An optional memory budget
unloads the least recently used models when another must load (model multiplexing); a model's size
is the size of its version folder's files.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from tokenmill.triton import pb_utils
from tokenmill.triton.backends import InferRequest, ModelError, Outputs, create_instances
from tokenmill.triton.config import TritonModelConfig, load_config
from tokenmill.triton.dtypes import protocol_of
from tokenmill.triton.ensemble import check_graph, run_ensemble
from tokenmill.triton.pbtxt import ConfigError
from tokenmill.triton.scheduling import BatchScheduler, DefaultScheduler, DynamicBatcher, InferError
from tokenmill.triton.sequence import SequenceBatcher
from tokenmill.triton.stats import ModelStats, TritonMetrics

log = logging.getLogger(__name__)
READY, UNAVAILABLE, LOADING, UNLOADING = "READY", "UNAVAILABLE", "LOADING", "UNLOADING"


@dataclass
class Version:
    version: str
    cfg: TritonModelConfig
    scheduler: BatchScheduler | None  # None for an ensemble
    stats: ModelStats
    size_bytes: int
    last_used: float = field(default_factory=time.monotonic)


@dataclass
class Entry:
    name: str
    state: str = UNAVAILABLE
    reason: str = ""
    versions: dict[str, Version] = field(default_factory=dict)
    signature: tuple = ()


def _signature(model_dir: Path) -> tuple:
    return tuple(
        sorted((str(p), p.stat().st_mtime_ns, p.stat().st_size) for p in model_dir.rglob("*") if p.is_file())
    )


def _versions(model_dir: Path, cfg: TritonModelConfig) -> list[str]:
    found = sorted(
        int(p.name) for p in model_dir.iterdir() if p.is_dir() and p.name.isdigit() and p.name[0] != "0"
    )
    policy = cfg.raw.get("version_policy", {})
    if "all" in policy:
        chosen = found
    elif "specific" in policy:
        chosen = [v for v in found if v in policy["specific"].get("versions", [])]
    else:
        chosen = found[-max(1, policy.get("latest", {}).get("num_versions", 1)) :]
    if cfg.backend == "ensemble" and not found:
        chosen = [1]  # an ensemble has no files; Triton still wants a version folder, we do not insist
    return [str(v) for v in chosen]


class ModelRepository:
    def __init__(
        self,
        root: Path,
        mode: str = "none",
        load_models: list[str] | None = None,
        poll_secs: float = 15.0,
        memory_budget_mb: float | None = None,
        metrics: TritonMetrics | None = None,
    ) -> None:
        if mode not in ("none", "poll", "explicit"):
            raise ValueError(f"--model-control-mode {mode!r}: use none, poll or explicit")
        if not root.is_dir():
            raise ValueError(f"--model-repository {root} is not a directory")
        self.root, self.mode, self.poll_secs = root, mode, poll_secs
        self.initial = list(load_models or [])
        self.budget = memory_budget_mb * 2**20 if memory_budget_mb else None
        self.metrics = metrics
        self.entries: dict[str, Entry] = {}
        self.lock = asyncio.Lock()
        self.poller: asyncio.Task | None = None
        self.loop: asyncio.AbstractEventLoop | None = None

    # --- lifecycle --------------------------------------------------------------------------------

    def model_dir(self, name: str) -> Path | None:
        """The folder of model `name`, or None when `name` is not a plain name of a folder in the
        repository: one path component (no '/', '\\', NUL, '.' or '..'), whose folder, symlinks
        resolved, is a direct child of the repository's. Names come from clients: `root / name` with
        '..' or an absolute path would leave the repository (and run the model.py found there)."""
        if not isinstance(name, str) or name in ("", ".", "..") or any(c in name for c in "/\\\0"):
            return None
        path = self.root / name
        try:
            if path.resolve().parent != self.root.resolve() or not path.is_dir():
                return None
        except (OSError, RuntimeError, ValueError):  # a symlink loop, a name the OS refuses
            return None
        return path

    def _has_model(self, name: str) -> bool:
        d = self.model_dir(name)
        return d is not None and (d / "config.pbtxt").is_file()

    def on_disk(self) -> list[str]:
        return sorted(p.name for p in self.root.iterdir() if self._has_model(p.name))

    async def start(self) -> None:
        self.loop = asyncio.get_running_loop()
        pb_utils._bls_hook = self._bls
        names = self.on_disk()
        if self.mode == "explicit":
            names = names if "*" in self.initial else self.initial
            unknown = [n for n in names if n not in self.on_disk()]
            if unknown:
                raise ValueError(f"--load-model {', '.join(unknown)}: not in {self.root}")
        for n in names:
            await self.load(n, strict=False, api=False)
        if self.mode == "poll":
            self.poller = asyncio.get_running_loop().create_task(self._poll())

    async def close(self) -> None:
        if self.poller:
            self.poller.cancel()
        for name in list(self.entries):
            await self._unload(name)

    async def _poll(self) -> None:
        while True:
            await asyncio.sleep(self.poll_secs)
            try:
                await self.rescan()
            except Exception:  # keep polling whatever one scan met
                log.exception("model repository poll failed")

    async def rescan(self) -> None:
        disk = set(self.on_disk())
        for name in list(self.entries):
            if name not in disk:
                await self.unload(name, api=False)
        for name in sorted(disk):
            e = self.entries.get(name)
            if e is None or e.signature != _signature(self.root / name):
                await self.load(name, strict=False, api=False)

    # --- load / unload -----------------------------------------------------------------------------

    async def load(self, name: str, strict: bool = True, api: bool = True) -> None:
        """Load (or reload) a model; with strict, a failure raises InferError(400)."""
        if api and self.mode != "explicit":
            raise InferError(
                400,
                "explicit model load / unload is not allowed if polling is enabled"
                if self.mode == "poll"
                else "model control mode is none: start the server with "
                "--model-control-mode explicit to load and unload models",
            )
        if not self._has_model(name):
            # The same answer for every name that is not a model of the repository, valid or not:
            # nothing tells whether a path outside it exists.
            if strict:
                raise InferError(400, f"failed to load {name!r}: no such model in the repository")
            return
        async with self.lock:
            entry = self.entries.setdefault(name, Entry(name))
            try:
                await self._load_locked(name)
            except (ConfigError, ModelError, ValueError, OSError, ImportError, SyntaxError, InferError) as e:
                # A failed reload keeps serving what was loaded before (as Triton does).
                entry.reason = str(getattr(e, "message", e))
                entry.state = READY if entry.versions else UNAVAILABLE
                log.error("model %s failed to load: %s", name, entry.reason)
                if strict:
                    raise InferError(400, f"failed to load {name!r}: {entry.reason}") from None

    async def _load_locked(self, name: str) -> None:
        """Load (or reload) a model with the lock held; an ensemble first loads its steps that are not
        ready. Raises on failure and leaves what was loaded before in place."""
        model_dir = self.model_dir(name)
        if model_dir is None or not (model_dir / "config.pbtxt").is_file():
            raise ValueError(f"model {name!r} is not in the repository")
        entry = self.entries.setdefault(name, Entry(name))
        entry.state, entry.reason = LOADING, ""
        cfg = load_config(model_dir)
        if cfg.backend == "ensemble":
            check_graph(cfg)
            for step in cfg.ensemble_steps:
                dep = self.entries.get(step["model_name"])
                if dep is None or dep.state != READY:
                    await self._load_locked(step["model_name"])
        versions = await self._make_versions(model_dir, cfg)
        old = entry.versions
        entry.versions, entry.state, entry.reason = versions, READY, ""
        entry.signature = _signature(model_dir)
        for v in old.values():
            if v.scheduler is not None:
                await v.scheduler.close()

    async def _make_versions(self, model_dir: Path, cfg: TritonModelConfig) -> dict[str, Version]:
        out = {}
        for v in _versions(model_dir, cfg):
            vdir = model_dir / v
            size = sum(p.stat().st_size for p in vdir.rglob("*") if p.is_file()) if vdir.is_dir() else 0
            await self._make_room(size, keep=cfg.name)
            stats = ModelStats(cfg.name, v, self.metrics)
            if cfg.backend == "ensemble":
                sched = None
            else:
                if not vdir.is_dir():
                    raise ModelError(f"{cfg.name}: version folder {vdir} is missing")
                instances = await asyncio.to_thread(create_instances, cfg, vdir)
                if cfg.sequence_batching is not None:
                    sched = SequenceBatcher(cfg, instances, stats)
                elif cfg.dynamic_batching is not None:
                    sched = DynamicBatcher(cfg, instances, stats)
                else:
                    sched = DefaultScheduler(cfg, instances, stats)
            out[v] = Version(v, cfg, sched, stats, size)
        if not out:
            raise ModelError(f"{cfg.name}: no version folder to serve in {model_dir}")
        return out

    async def _make_room(self, size: int, keep: str) -> None:
        if self.budget is None:
            return
        if size > self.budget:
            raise ModelError(f"{keep}: needs {size / 2**20:.1f} MiB, more than the memory budget")
        while self._used() + size > self.budget:
            victims = [
                (min(v.last_used for v in e.versions.values()), n)
                for n, e in self.entries.items()
                if n != keep and e.state == READY and e.versions and not self._is_dependency(n)
            ]
            if not victims:
                raise ModelError(f"{keep}: the memory budget is full and nothing can be unloaded")
            _, victim = min(victims)
            log.info("memory budget: unloading least recently used model %s", victim)
            await self._unload(victim)

    def _used(self) -> int:
        return sum(v.size_bytes for e in self.entries.values() for v in e.versions.values())

    def _is_dependency(self, name: str) -> bool:
        return any(
            name in {s["model_name"] for s in v.cfg.ensemble_steps}
            for e in self.entries.values()
            for v in e.versions.values()
            if e.state == READY
        )

    async def unload(self, name: str, unload_dependents: bool = False, api: bool = True) -> None:
        if api and self.mode != "explicit":
            raise InferError(400, "model control mode is not explicit: unloading is not allowed")
        if name not in self.entries and self.model_dir(name) is None:
            raise InferError(400, f"failed to unload {name!r}: no such model")
        async with self.lock:
            deps = []
            if unload_dependents and name in self.entries:
                for v in self.entries[name].versions.values():
                    deps += [s["model_name"] for s in v.cfg.ensemble_steps]
            await self._unload(name)
            for d in deps:
                await self._unload(d)

    async def _unload(self, name: str) -> None:
        e = self.entries.get(name)
        if e is None:
            return
        e.state = UNLOADING
        for v in e.versions.values():
            if v.scheduler is not None:
                await v.scheduler.close()
        e.versions, e.state, e.reason = {}, UNAVAILABLE, "unloaded"

    # --- queries -------------------------------------------------------------------------------------

    def index(self, ready_only: bool = False) -> list[dict]:
        out = []
        for name in sorted(set(self.on_disk()) | set(self.entries)):
            e = self.entries.get(name)
            if e is None:
                out.append({"name": name, "version": "", "state": UNAVAILABLE, "reason": "unloaded"})
                continue
            if e.versions:
                out += [
                    {"name": name, "version": v, "state": e.state, "reason": e.reason} for v in e.versions
                ]
            else:
                out.append({"name": name, "version": "", "state": e.state, "reason": e.reason})
        return [m for m in out if m["state"] == READY] if ready_only else out

    def get(self, name: str, version: str | int | None = None) -> Version:
        e = self.entries.get(name)
        if e is None and self.model_dir(name) is None:
            raise InferError(404, f"unknown model: {name!r}")
        if e is None or e.state != READY or not e.versions:
            reason = f" ({e.reason})" if e is not None and e.reason else ""
            raise InferError(503, f"model {name!r} is not ready{reason}")
        if version in (None, "", -1, "-1"):
            return e.versions[max(e.versions, key=int)]
        v = e.versions.get(str(version))
        if v is None:
            raise InferError(
                404, f"model {name!r} has no version {version} (serving {', '.join(e.versions)})"
            )
        return v

    def ready(self, name: str, version: str | None = None) -> bool:
        try:
            self.get(name, version)
            return True
        except InferError:
            return False

    def all_ready(self) -> bool:
        return all(
            e.state == READY
            for e in self.entries.values()
            if e.state != UNAVAILABLE or e.reason != "unloaded"
        )

    # --- inference -------------------------------------------------------------------------------------

    async def infer(self, name: str, version: str | int | None, req: InferRequest) -> Outputs:
        v = self.get(name, version)
        v.last_used = time.monotonic()
        t0 = time.perf_counter_ns()
        try:
            self._validate(v.cfg, req)
            if v.scheduler is None:
                started = time.perf_counter_ns()
                out = await run_ensemble(v.cfg, req, self.infer)
            else:
                out = await v.scheduler.submit(req)
            out = self._select(v.cfg, req, out)
        except InferError as e:
            v.stats.finished(False, time.perf_counter_ns() - t0, e.reason)
            raise
        if v.scheduler is None:  # a model's scheduler counts its executions; an ensemble's are counted here
            v.stats.ensemble_ran(req.batch_size(v.cfg), started - t0, req.times)
        v.stats.finished(True, time.perf_counter_ns() - t0)
        return out

    def _validate(self, cfg: TritonModelConfig, req: InferRequest) -> None:
        declared = {t.name: t for t in cfg.inputs}
        for n in req.inputs:
            if n not in declared:
                raise InferError(
                    400,
                    f"unexpected inference input {n!r} for model {cfg.name!r} "
                    f"(inputs: {', '.join(declared)})",
                )
        batch = None
        for t in cfg.inputs:
            a = req.inputs.get(t.name)
            if a is None:
                if t.optional:
                    continue
                raise InferError(400, f"expected input {t.name!r} for model {cfg.name!r}")
            got = protocol_of(a)
            if got != t.datatype:
                raise InferError(
                    400, f"input {t.name!r} of model {cfg.name!r}: datatype {got}, expected {t.datatype}"
                )
            shape = list(a.shape)
            dims = list(t.dims)
            if cfg.batched:
                if not shape:
                    raise InferError(
                        400, f"input {t.name!r}: a batched model needs a leading batch dimension"
                    )
                b, shape = shape[0], shape[1:]
                if batch is not None and b != batch:
                    raise InferError(
                        400, f"input {t.name!r}: batch size {b} differs from the other inputs' {batch}"
                    )
                batch = b
                if b > cfg.max_batch_size or b < 1:
                    raise InferError(
                        400, f"input {t.name!r}: batch size {b} is outside 1..{cfg.max_batch_size}"
                    )
            if len(shape) != len(dims) or any(d != -1 and d != s for d, s in zip(dims, shape, strict=False)):
                want = ([-1] if cfg.batched else []) + dims
                raise InferError(
                    400, f"input {t.name!r} of model {cfg.name!r}: shape {list(a.shape)}, expected {want}"
                )
        known = {t.name for t in cfg.outputs}
        for n in req.requested_outputs or []:
            if n not in known:
                raise InferError(400, f"unexpected requested output {n!r} for model {cfg.name!r}")

    @staticmethod
    def _select(cfg: TritonModelConfig, req: InferRequest, out: Outputs) -> Outputs:
        names = req.requested_outputs or [t.name for t in cfg.outputs]
        missing = [n for n in names if n not in out]
        if missing:
            raise InferError(500, f"model {cfg.name!r} did not produce {', '.join(missing)}")
        return {n: np.asarray(out[n]) for n in names}

    def _bls(self, r: pb_utils.InferenceRequest) -> pb_utils.InferenceResponse:
        """A Python model's BLS call, from its worker thread into the server's loop."""
        assert self.loop is not None
        req = InferRequest(
            {t.name(): t.as_numpy() for t in r.inputs()},
            r.requested_output_names() or None,
            request_id=r.request_id(),
        )
        fut = asyncio.run_coroutine_threadsafe(self.infer(r.model_name, r._version, req), self.loop)
        try:
            out = fut.result()
        except InferError as e:
            return pb_utils.InferenceResponse(error=pb_utils.TritonError(e.message))
        return pb_utils.InferenceResponse([pb_utils.Tensor(n, a) for n, a in out.items()])
