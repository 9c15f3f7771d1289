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
import contextlib
import json
import logging
import queue
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from tokenmill.triton import pb_utils
from tokenmill.triton.backends import InferRequest, ModelError, Outputs, create_instances
from tokenmill.triton.config import TritonModelConfig, load_config
from tokenmill.triton.decoupled import ResponseStream, StreamItem
from tokenmill.triton.dtypes import protocol_of
from tokenmill.triton.ensemble import check_graph, run_ensemble, stream_ensemble
from tokenmill.triton.pbtxt import ConfigError
from tokenmill.triton.response_cache import ResponseCache, check_cacheable, make_key
from tokenmill.triton.scheduling import BatchScheduler, DefaultScheduler, DynamicBatcher, InferError
from tokenmill.triton.sequence import SequenceBatcher
from tokenmill.triton.stats import ModelStats, TritonMetrics
from tokenmill.triton.warmup import run_warmup, warmup_requests

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
    # Which load this is: part of the response cache's key, so a request that was running on the
    # previous load when the model was reloaded cannot store that load's outputs for this one.
    loaded_ns: int = field(default_factory=time.monotonic_ns)
    # A decoupled model's requests whose responses are not complete: failed if the model goes away.
    streams: set[ResponseStream] = field(default_factory=set)

    async def close(self, why: str, drain_s: float = 10.0) -> None:
        """Stop serving this version: its requests still answering get up to `drain_s` to finish (a
        reload keeps the old version serving them, as Triton does), the rest end with `why`."""
        deadline = time.monotonic() + drain_s
        while self.streams and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        for s in list(self.streams):
            s.fail(why, 503)
        if self.scheduler is not None:
            await self.scheduler.close()


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
        cache: ResponseCache | None = None,
    ) -> None:
        if mode not in ("none", "poll", "explicit"):
            raise ValueError(f"--model-control-mode {mode!r}: use none, poll or explicit")
        if not root.is_dir():
            raise ValueError(f"--model-repository {root} is not a directory")
        self.root, self.mode, self.poll_secs = root, mode, poll_secs
        self.initial = list(load_models or [])
        self.budget = memory_budget_mb * 2**20 if memory_budget_mb else None
        self.metrics = metrics
        self.cache = cache  # --cache-config: shared by the models with response_cache { enable: true }
        self.entries: dict[str, Entry] = {}
        self.lock = asyncio.Lock()
        self.poller: asyncio.Task | None = None
        self.loop: asyncio.AbstractEventLoop | None = None
        self.llm: tuple[str, Any] | None = None  # (served name, AsyncLLM): the LLM as a model (add_llm)
        self.loras: Any = None  # the server's LoRA registry (server/app.py): each adapter a model too
        self.adapter_models: set[str] = set()  # the adapters' entries (_sync_adapters)
        self.admission: Any = None  # the server's admission control (server/app.py), for the LLM's requests
        self._closing: set[asyncio.Task] = set()

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

    def add_llm(self, name: str, llm: Any) -> None:
        """Serve the server's LLM as model `name` of the repository (triton/llm_model.py), from start()."""
        self.llm = (name, llm)

    def builtin(self, name: str) -> bool:
        return self.llm is not None and (self.llm[0] == name or name in self.adapter_models)

    def _sync_adapters(self) -> None:
        """Each LoRA adapter the server serves is a model named for it, as the LLM is: added when it
        appears (adapters load and unload at run time) and retired when it goes."""
        if self.llm is None or self.loop is None:
            return
        from tokenmill.triton.llm_model import LLMInstance, llm_config

        have = set(self.loras.adapters) if self.loras is not None else set()
        for name in have - set(self.entries):
            if self._has_model(name):
                continue  # a repository model of that name wins; the adapter stays an OpenAI model
            cfg = llm_config(name, 16)
            stats = ModelStats(name, "1", self.metrics)
            inst = LLMInstance(
                cfg, self.llm[1], self.loop, lora=lambda n=name: self.loras.get(n), admission=self.admission
            )
            sched = DefaultScheduler(cfg, [inst], stats)
            self.entries[name] = Entry(name, READY, versions={"1": Version("1", cfg, sched, stats, 0)})
            self.adapter_models.add(name)
        for name in self.adapter_models - have:
            self.adapter_models.discard(name)
            for v in self.entries.pop(name).versions.values():
                task = self.loop.create_task(v.close(f"LoRA adapter {name!r} was unloaded"))
                self._closing.add(task)  # (held until done: the loop keeps only weak references)
                task.add_done_callback(self._closing.discard)

    async def _start_llm(self) -> None:
        from tokenmill.triton.llm_model import LLMInstance, llm_config

        assert self.llm is not None and self.loop is not None
        name, llm = self.llm
        if self.model_dir(name) is not None:
            raise ValueError(
                f"--model-repository {self.root} has a model named {name!r}, the served LLM's name: "
                "rename one of them (--served-model-name)"
            )
        cfg = llm_config(name, 16)
        stats = ModelStats(name, "1", self.metrics)
        sched = DefaultScheduler(cfg, [LLMInstance(cfg, llm, self.loop, admission=self.admission)], stats)
        self.entries[name] = Entry(name, READY, versions={"1": Version("1", cfg, sched, stats, 0)})

    async def start(self) -> None:
        self.loop = asyncio.get_running_loop()
        pb_utils._bls_hook = self._bls
        pb_utils._bls_stream_hook = self._bls_stream
        if self.llm is not None:
            await self._start_llm()
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
            await self._unload(name, drain_s=0.0)  # the server is stopping: its drain has run
        if getattr(self, "shm", None) is not None:  # the shared-memory regions clients registered
            self.shm.close()

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
            if name not in disk and not self.builtin(name):
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
        if self.builtin(name):
            return  # the server's LLM is always loaded
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
        steps = [v.cfg for s in cfg.ensemble_steps for v in self.entries[s["model_name"]].versions.values()]
        reason = check_cacheable(cfg, steps)
        if reason is not None:
            raise ConfigError(reason)
        versions = await self._make_versions(model_dir, cfg)
        old = entry.versions
        entry.versions, entry.state, entry.reason = versions, READY, ""
        entry.signature = _signature(model_dir)
        self._drop_cached(name)
        for v in old.values():
            await v.close(f"model {name!r} was reloaded")

    def _drop_cached(self, name: str) -> None:
        """Forget the cached responses of a model that was (re)loaded or unloaded, and of the ensembles
        that run it: its code or files may have changed under the same version."""
        if self.cache is None:
            return
        users = [
            n
            for n, e in self.entries.items()
            for v in e.versions.values()
            if name in {s["model_name"] for s in v.cfg.ensemble_steps}
        ]
        self.cache.evict_models([name, *users])

    async def _make_versions(self, model_dir: Path, cfg: TritonModelConfig) -> dict[str, Version]:
        out: dict[str, Version] = {}
        samples = warmup_requests(cfg, model_dir)  # a sample that does not fit fails before any instance
        for v in _versions(model_dir, cfg):
            vdir = model_dir / v
            # (A tensorrtllm model's engine files are not read: the served LLM runs it.)
            sized = vdir.is_dir() and cfg.backend != "tensorrtllm"
            size = sum(p.stat().st_size for p in vdir.rglob("*") if p.is_file()) if sized else 0
            await self._make_room(size, keep=cfg.name)
            stats = ModelStats(cfg.name, v, self.metrics)
            if cfg.backend == "ensemble":
                sched = None
            elif cfg.backend == "tensorrtllm":
                sched = self._trtllm_scheduler(cfg, stats)
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
                try:  # every instance runs the samples before the model is READY (as Triton)
                    await run_warmup(cfg, sched, samples)
                except BaseException:
                    await sched.close()
                    for made in out.values():
                        await made.close(f"model {cfg.name!r} failed to load")
                    raise
            out[v] = Version(v, cfg, sched, stats, size)
        if not out:
            raise ModelError(f"{cfg.name}: no version folder to serve in {model_dir}")
        return out

    def _trtllm_scheduler(self, cfg: TritonModelConfig, stats: ModelStats) -> DefaultScheduler:
        """A TensorRT-LLM model runs on the server's LLM: one instance hands every request to the
        engine, whose in-flight batching is the batching (the config's dynamic_batching and instance
        count do not apply). It answers through a response stream whatever its declared policy, which
        the instance enforces (one response unless decoupled)."""
        from tokenmill.triton.trtllm_model import TrtLlmInstance

        if self.llm is None or self.loop is None:
            raise ModelError(
                f"{cfg.name}: backend tensorrtllm runs on the LLM this server serves, and it serves none "
                "(serve it with `tokenmill serve --model-repository ...`)"
            )
        cfg.decoupled = True
        inst = TrtLlmInstance(cfg, self.llm[1], self.loop, self.admission)
        log.info(
            "model %s (backend tensorrtllm) runs on the served LLM %s; its engine parameters are not read",
            cfg.name,
            self.llm[0],
        )
        return DefaultScheduler(cfg, [inst], stats)

    async def _make_room(self, size: int, keep: str) -> None:
        if self.budget is None:
            return
        if size > self.budget:
            raise ModelError(f"{keep}: needs {size / 2**20:.1f} MiB, more than the memory budget")
        while self._used() + size > self.budget:
            victims = [
                (min(v.last_used for v in e.versions.values()), n)
                for n, e in self.entries.items()
                if n != keep
                and e.state == READY
                and e.versions
                and not self._is_dependency(n)
                and not self.builtin(n)
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
        if self.builtin(name):
            raise InferError(
                400, f"{name!r} is the server's LLM or one of its LoRA adapters: the OpenAI side serves it"
            )
        async with self.lock:
            deps = []
            if unload_dependents and name in self.entries:
                for v in self.entries[name].versions.values():
                    deps += [s["model_name"] for s in v.cfg.ensemble_steps]
            await self._unload(name)
            for d in deps:
                await self._unload(d)

    async def _unload(self, name: str, drain_s: float = 10.0) -> None:
        e = self.entries.get(name)
        if e is None:
            return
        e.state = UNLOADING
        self._drop_cached(name)
        for v in e.versions.values():
            await v.close(f"model {name!r} was unloaded", drain_s)
        e.versions, e.state, e.reason = {}, UNAVAILABLE, "unloaded"

    # --- queries -------------------------------------------------------------------------------------

    def index(self, ready_only: bool = False) -> list[dict]:
        self._sync_adapters()
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
        self._sync_adapters()
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
        if v.cfg.decoupled and v.scheduler is not None:
            return await self._one_response(name, version, req)
        v.last_used = time.monotonic()
        t0 = time.perf_counter_ns()
        key, lookup_ns = None, 0
        try:
            self._validate(v.cfg, req)
            if self.cache is not None and v.cfg.response_cache:
                t_lookup = time.perf_counter_ns()
                key = make_key(
                    name, f"{v.version}@{v.loaded_ns}", req.inputs, req.requested_outputs, req.parameters
                )
                hit = self.cache.lookup(key)
                lookup_ns = time.perf_counter_ns() - t_lookup
                if hit is not None:  # a success without running the model (nor an ensemble's steps)
                    v.stats.cache_hit(t_lookup - t0, lookup_ns)
                    v.stats.finished(True, time.perf_counter_ns() - t0)
                    return hit
            if v.scheduler is None:
                started = time.perf_counter_ns()
                out = await run_ensemble(v.cfg, req, self.infer)
            else:
                out = await v.scheduler.submit(req)
            out = self._select(v.cfg, req, out)
        except InferError as e:
            v.stats.finished(False, time.perf_counter_ns() - t0, e.reason)
            raise
        if key is not None and self.cache is not None:  # only successful responses are stored
            t_insert = time.perf_counter_ns()
            self.cache.insert(key, out)
            v.stats.cache_miss(lookup_ns + time.perf_counter_ns() - t_insert)
        if v.scheduler is None:  # a model's scheduler counts its executions; an ensemble's are counted here
            v.stats.ensemble_ran(req.batch_size(v.cfg), started - t0, req.times)
        v.stats.finished(True, time.perf_counter_ns() - t0)
        return out

    async def infer_stream(
        self, name: str, version: str | int | None, req: InferRequest
    ) -> AsyncIterator[StreamItem]:
        """A request's responses as they come: a decoupled model's 0..n (the last one final), or a
        model's one. Errors found before the model runs (unknown model, bad input) raise InferError at
        the first step; a failure after that arrives as a final item with the error."""
        v = self.get(name, version)
        through = self._decoupled_step(v.cfg)
        if through is not None:
            async with contextlib.aclosing(self._stream_ensemble(v, req, through)) as items:
                async for item in items:
                    yield item
            return
        if not v.cfg.decoupled or v.scheduler is None:  # (an ensemble says decoupled for its step)
            try:
                out = await self.infer(name, version, req)
            except InferError as e:
                if e.status < 500:  # the request's own fault: said before any response, as HTTP would
                    raise
                yield StreamItem(error=e.message, final=True)
                return
            yield StreamItem(outputs=out, final=True)
            return
        v.last_used = time.monotonic()
        t0 = time.perf_counter_ns()
        try:
            self._validate(v.cfg, req)
        except InferError as e:
            v.stats.finished(False, time.perf_counter_ns() - t0, e.reason)
            raise
        assert v.scheduler is not None  # (an ensemble took the branch above)
        stream = ResponseStream(asyncio.get_running_loop())
        req.stream = stream
        v.streams.add(stream)
        task = asyncio.ensure_future(v.scheduler.submit(req))

        def settle(t: asyncio.Future) -> None:
            # The scheduler refused the request, or execute() raised: the stream ends with why.
            if t.cancelled():
                stream.fail(f"model {name!r}: the request was cancelled", 503)
            elif t.exception() is not None:
                e = t.exception()
                if isinstance(e, InferError):
                    stream.fail(e.message, e.status)
                else:
                    stream.fail(f"model {name!r} failed: {e}")

        task.add_done_callback(settle)
        wanted = set(req.requested_outputs or [t.name for t in v.cfg.outputs])
        ok = True
        try:
            async for item in stream:
                if item.outputs is not None:
                    outputs = {n: np.asarray(a) for n, a in item.outputs.items() if n in wanted}
                    item = StreamItem(outputs, item.error, item.final)
                ok = ok and item.error is None
                yield item
        finally:
            v.streams.discard(stream)
            if not stream.closed:  # the reader went away before the FINAL flag
                stream.cancel()
                ok = False
            v.stats.finished(ok, time.perf_counter_ns() - t0)

    def _decoupled_step(self, cfg: TritonModelConfig) -> int | None:
        """The step of an ensemble that is a decoupled model (its responses stream through the steps
        after it), or None; more than one is refused."""
        found = []
        for i, step in enumerate(cfg.ensemble_steps):
            e = self.entries.get(step["model_name"])
            if e is not None and any(v.cfg.decoupled for v in e.versions.values()):
                found.append(i)
        if len(found) > 1:
            names = ", ".join(cfg.ensemble_steps[i]["model_name"] for i in found)
            raise InferError(
                400, f"ensemble {cfg.name!r} streams through one decoupled step, not several ({names})"
            )
        return found[0] if found else None

    async def _stream_ensemble(self, v: Version, req: InferRequest, step: int) -> AsyncIterator[StreamItem]:
        v.last_used = time.monotonic()
        t0 = time.perf_counter_ns()
        ok = False
        try:
            self._validate(v.cfg, req)
            items = stream_ensemble(v.cfg, req, self.infer, self.infer_stream, step)
            async with contextlib.aclosing(items) as responses:
                try:
                    async for item in responses:
                        ok = item.error is None
                        yield item
                except InferError as e:  # a step after the decoupled one failed: this stream's end
                    ok = False
                    yield StreamItem(error=e.message, final=True, status=e.status)
        finally:
            if ok:
                v.stats.ensemble_ran(req.batch_size(v.cfg), 0, req.times)
            v.stats.finished(ok, time.perf_counter_ns() - t0)

    async def _one_response(self, name: str, version: str | int | None, req: InferRequest) -> Outputs:
        """A decoupled model asked for one answer (HTTP infer, gRPC ModelInfer, an ensemble step, a BLS
        call): its responses must be exactly one."""
        req.one_response = True
        async with contextlib.aclosing(self.infer_stream(name, version, req)) as items:
            answers = [i async for i in items if i.outputs is not None or i.error is not None]
        for i in answers:
            if i.error is not None:
                if i.status != 500:  # the request's fault, or the model's unavailability: said as such
                    raise InferError(i.status, i.error)
                said = (
                    i.error if i.error.startswith(f"model {name!r}") else f"model {name!r} failed: {i.error}"
                )
                raise InferError(500, said, "BACKEND")
        if len(answers) != 1:
            raise InferError(
                400,
                f"model {name!r} is decoupled and sent {len(answers)} responses to this request: read them "
                "with gRPC ModelStreamInfer or POST /v2/models/<name>/generate_stream",
            )
        return answers[0].outputs or {}

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

    @staticmethod
    def _bls_request(r: pb_utils.InferenceRequest) -> InferRequest:
        """A BLS call as the called model receives it: inputs, outputs, id, parameters, flags and
        correlation ID (a BLS call to a sequence model, or to the LLM with its settings)."""
        try:
            params = json.loads(r.parameters())
        except ValueError:
            params = {}
        return InferRequest(
            {t.name(): t.as_numpy() for t in r.inputs()},
            r.requested_output_names() or None,
            parameters=params if isinstance(params, dict) else {},
            request_id=r.request_id(),
            correlation_id=r.correlation_id(),
            flags=r.flags(),
            timeout_us=int(r.timeout() or 0),
        )

    def _bls(self, r: pb_utils.InferenceRequest) -> pb_utils.InferenceResponse:
        """A Python model's BLS call, from its worker thread into the server's loop."""
        assert self.loop is not None
        req = self._bls_request(r)
        fut = asyncio.run_coroutine_threadsafe(self.infer(r.model_name, r._version, req), self.loop)
        try:
            out = fut.result()
        except InferError as e:
            return pb_utils.InferenceResponse(error=pb_utils.TritonError(e.message))
        return pb_utils.InferenceResponse([pb_utils.Tensor(n, a) for n, a in out.items()])

    def _bls_stream(self, r: pb_utils.InferenceRequest) -> tuple[queue.Queue, Callable[[], None]]:
        """A decoupled BLS call (`exec(decoupled=True)`): its responses fill a queue the calling model's
        thread reads; cancelling stops the call (the called model sees is_cancelled())."""
        assert self.loop is not None
        q: queue.Queue[StreamItem] = queue.Queue()
        req = self._bls_request(r)

        async def pump() -> None:
            try:
                async with contextlib.aclosing(self.infer_stream(r.model_name, r._version, req)) as items:
                    async for item in items:
                        q.put(item)
            except InferError as e:
                q.put(StreamItem(error=e.message, final=True))
            except asyncio.CancelledError:
                q.put(StreamItem(error="the BLS request was cancelled", final=True))
                raise
            except Exception as e:  # anything else still ends the caller's iteration
                q.put(StreamItem(error=f"BLS request to {r.model_name!r} failed: {e}", final=True))

        fut = asyncio.run_coroutine_threadsafe(pump(), self.loop)
        return q, fut.cancel
