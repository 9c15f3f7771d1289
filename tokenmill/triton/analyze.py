"""`tokenmill analyze`: a Model Analyzer for one model of a Triton repository.

Brute search as Model Analyzer's: every combination of instance count, max batch size (dynamic
batching on whenever the model batches) and max queue delay is written as a variant config.pbtxt,
loaded into one server (analyze_load.py) and driven at each client concurrency; the best variant is
the one with the highest throughput whose p99 latency meets the limit. `quick` prunes as a person
would: no higher concurrency once p99 passed the limit or throughput stopped growing, no longer delay
or bigger batch once it stopped paying. The best is written as a config.pbtxt and measured once more.
"""

from __future__ import annotations

import copy
import csv
import json
import shutil
import tempfile
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Protocol

import numpy as np

from tokenmill.triton.analyze_load import (
    LoadError,
    LoadGenerator,
    LoadSettings,
    Measurement,
    TritonServer,
    encode_request,
    input_shapes,
    make_inputs,
)
from tokenmill.triton.config import SCHEMA, TritonModelConfig, load_config
from tokenmill.triton.pbtxt import ConfigError, format_config

GAIN = 1.05  # quick mode: a step that does not add 5 % throughput is not worth going further for
BODIES = 16  # distinct request bodies cycled through (perf_analyzer also sends pre-generated data)


class AnalyzeError(ValueError):
    """Input the analysis cannot run on; the message is one line."""


@dataclass(frozen=True)
class Variant:
    """One model configuration of the sweep."""

    instances: int
    max_batch_size: int  # 0: the model does not batch
    queue_delay_us: int | None  # None: no dynamic batching

    @property
    def name(self) -> str:
        delay = "" if self.queue_delay_us is None else f"_d{self.queue_delay_us}"
        return f"i{self.instances}_b{self.max_batch_size}{delay}"

    @property
    def label(self) -> str:
        if self.max_batch_size == 0:
            return f"{self.instances} inst, no batching"
        return f"{self.instances} inst, batch {self.max_batch_size}, delay {self.queue_delay_us} µs"


@dataclass
class Spec:
    """What to sweep, as the command line gives it."""

    repository: Path
    model: str
    latency_limit_ms: float
    output_dir: Path
    instances: list[int] = field(default_factory=lambda: [1, 2])
    max_batch: list[int] | None = None  # None: powers of 2 up to 16 when the model batches
    queue_delay_us: list[int] = field(default_factory=lambda: [0, 100, 500, 2000])
    concurrency: list[int] = field(default_factory=lambda: [1, 2, 4, 8, 16, 32])
    load: LoadSettings = field(default_factory=LoadSettings)
    quick: bool = False
    input_data: str = "random"
    shapes: dict[str, list[int]] = field(default_factory=dict)
    seed: int = 0


@dataclass
class Row:
    variant: Variant
    m: Measurement

    def meets(self, limit_ms: float) -> bool:
        return self.m.errors == 0 and self.m.latency_p99_ms <= limit_ms


@dataclass
class Result:
    spec: Spec
    rows: list[Row] = field(default_factory=list)
    failed: dict[str, str] = field(default_factory=dict)  # variant name -> why it could not be measured
    best: Row | None = None
    remeasured: Measurement | None = None
    remeasure_error: str = ""
    files: dict[str, Path] = field(default_factory=dict)

    @property
    def remeasured_meets(self) -> bool:
        m = self.remeasured
        return m is not None and m.errors == 0 and m.latency_p99_ms <= self.spec.latency_limit_ms


class ProgressLike(Protocol):
    """rich.progress.Progress's calls (tokenmill.cli.common.Steps has them)."""

    def add_task(self, description: str, total: float | None = None) -> Any: ...
    def update(self, task: Any, completed: float | None = None, description: str | None = None) -> None: ...
    def advance(self, task: Any, amount: float = 1.0) -> None: ...


class _NoProgress:
    def add_task(self, description: str, total: float | None = None) -> int:
        return 0

    def update(self, task: Any, completed: float | None = None, description: str | None = None) -> None:
        pass

    def advance(self, task: Any, amount: float = 1.0) -> None:
        pass


# --- the model and its variants ---------------------------------------------------------------------


def check_model(repository: Path, model: str) -> TritonModelConfig:
    """The model's configuration, or AnalyzeError saying why it cannot be analyzed."""
    if not repository.is_dir():
        raise AnalyzeError(f"repository {repository} is not a directory")
    names = sorted(p.name for p in repository.iterdir() if (p / "config.pbtxt").is_file())
    if model not in names or "/" in model or model in (".", ".."):
        listed = ", ".join(names) if names else "none"
        raise AnalyzeError(f"model {model!r} is not in repository {repository} (its models: {listed})")
    try:
        cfg = load_config(repository / model)
    except ConfigError as e:
        raise AnalyzeError(str(e)) from None
    if cfg.backend == "ensemble":
        raise AnalyzeError(
            f"model {model!r} is an ensemble: tokenmill analyze does not support ensembles yet "
            "(analyze its steps one by one)"
        )
    if cfg.sequence_batching is not None:
        raise AnalyzeError(f"model {model!r} uses sequence_batching: sequence models are not supported yet")
    if cfg.decoupled:
        raise AnalyzeError(f"model {model!r} is decoupled: decoupled models are not supported yet")
    return cfg


def variants(cfg: TritonModelConfig, spec: Spec) -> list[Variant]:
    """The sweep's configurations, in the order they are measured. A model whose config says
    max_batch_size 0 does not batch (nothing says it could): only its instance count is swept. Batch 1
    sends every request alone, so the queue delay (time to wait for a fuller batch) is not swept there."""
    if not cfg.batched:
        return [Variant(n, 0, None) for n in spec.instances]
    batches = spec.max_batch or [2**k for k in range(5)]
    out = []
    for n in spec.instances:
        for b in batches:
            out += [Variant(n, b, d) for d in (spec.queue_delay_us if b > 1 else [0])]
    return out


def variant_config(cfg: TritonModelConfig, v: Variant) -> dict[str, Any]:
    """The model's own configuration (decoded) with the variant's settings in place."""
    raw = copy.deepcopy(cfg.raw)
    raw["name"] = cfg.name
    groups = raw.get("instance_group") or [{}]
    raw["instance_group"] = [{"count": v.instances, "kind": groups[0].get("kind", "KIND_CPU")}]
    if v.max_batch_size:
        raw["max_batch_size"] = v.max_batch_size
        dyn = dict(raw.get("dynamic_batching") or {})
        dyn["max_queue_delay_microseconds"] = v.queue_delay_us or 0
        preferred = [p for p in dyn.pop("preferred_batch_size", []) if p <= v.max_batch_size]
        if preferred:
            dyn["preferred_batch_size"] = preferred
        raw["dynamic_batching"] = dyn
    return raw


def _stage(src: Path, dest: Path) -> None:
    """dest: a folder holding src's files (version folders and all), each linked rather than copied
    (a model can be gigabytes), and a config.pbtxt of its own written per variant."""
    dest.mkdir(parents=True)
    for p in src.iterdir():
        if p.name == "config.pbtxt":
            continue
        try:
            (dest / p.name).symlink_to(p.resolve(), target_is_directory=p.is_dir())
        except OSError:  # a file system without symbolic links
            (shutil.copytree if p.is_dir() else shutil.copy2)(p, dest / p.name)


# --- the sweep --------------------------------------------------------------------------------------


def _best(rows: list[Row], limit_ms: float) -> Row | None:
    ok = [r for r in rows if r.meets(limit_ms)]
    return max(ok, key=lambda r: (r.m.throughput, -r.m.latency_p99_ms)) if ok else None


def _score(rows: list[Row], limit_ms: float) -> float:
    best = _best(rows, limit_ms)
    return best.m.throughput if best else 0.0


async def run(
    spec: Spec,
    progress: ProgressLike | None = None,
    on_config: Callable[[Variant, list[Row], str], None] | None = None,
) -> Result:
    """Sweep, write the outputs, re-measure the best. `on_config(variant, rows, failure)` is called as
    each configuration is done (for its table)."""
    if spec.latency_limit_ms <= 0:
        raise AnalyzeError("--latency-limit-ms must be positive")
    cfg = check_model(spec.repository, spec.model)
    try:
        input_shapes(cfg, spec.shapes)
    except LoadError as e:
        raise AnalyzeError(str(e)) from None
    progress = progress or _NoProgress()
    result = Result(spec)
    scratch = Path(tempfile.mkdtemp(prefix="tokenmill-analyze-"))
    try:
        root = scratch / "repository"
        _stage(spec.repository / spec.model, root / spec.model)
        rng = np.random.default_rng(spec.seed)
        bodies = [encode_request(make_inputs(cfg, spec.shapes, spec.input_data, rng)) for _ in range(BODIES)]
        server = TritonServer(root)
        try:
            gen = LoadGenerator(server, spec.model, bodies)
            await _sweep(cfg, spec, server, gen, progress, on_config, result)
            result.best = _best(result.rows, spec.latency_limit_ms)
            if result.best is not None:
                task = progress.add_task(f"re-measuring {result.best.variant.name}", total=1)
                try:
                    await _load(server, cfg, result.best.variant, root)
                    result.remeasured = await gen.measure(result.best.m.concurrency, spec.load)
                except LoadError as e:  # the sweep's results stand, and are written
                    result.remeasure_error = str(e)
                progress.advance(task)
        finally:
            await server.aclose()
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    result.files = write_outputs(result, cfg)
    return result


async def _load(server: TritonServer, cfg: TritonModelConfig, v: Variant, root: Path) -> None:
    await server.unload(cfg.name)
    (root / cfg.name / "config.pbtxt").write_text(format_config(variant_config(cfg, v), SCHEMA))
    await server.load(cfg.name)


async def _sweep(
    cfg: TritonModelConfig,
    spec: Spec,
    server: TritonServer,
    gen: LoadGenerator,
    progress: ProgressLike,
    on_config: Callable[[Variant, list[Row], str], None] | None,
    result: Result,
) -> None:
    todo = variants(cfg, spec)
    levels = sorted(set(spec.concurrency))
    task = progress.add_task(f"analyzing {spec.model}", total=len(todo) * len(levels))
    score: dict[Variant, float] = {}
    for v in todo:
        if spec.quick and _pruned(v, score):
            progress.advance(task, len(levels))
            continue
        rows: list[Row] = []
        failure = ""
        try:
            await _load(server, cfg, v, server.root)
            await gen.probe()
            for i, c in enumerate(levels):
                progress.update(task, description=f"{v.name} at concurrency {c}")
                rows.append(Row(v, await gen.measure(c, spec.load)))
                progress.advance(task)
                if spec.quick and _saturated(rows, spec.latency_limit_ms):
                    progress.advance(task, len(levels) - i - 1)
                    break
        except LoadError as e:
            failure = str(e)
            result.failed[v.name] = failure
            progress.advance(task, len(levels) - len(rows))
        result.rows += rows
        score[v] = _score(rows, spec.latency_limit_ms)
        if on_config is not None:
            on_config(v, rows, failure)
    if not result.rows:
        first = next(iter(result.failed.values()), "nothing was measured")
        raise AnalyzeError(f"no configuration of {spec.model!r} could be measured: {first}")


def _saturated(rows: list[Row], limit_ms: float) -> bool:
    """Quick mode: more concurrency would only queue (p99 past the limit, or no more throughput)."""
    last = rows[-1].m
    if last.latency_p99_ms > limit_ms:
        return True
    return len(rows) > 1 and last.throughput < GAIN * rows[-2].m.throughput


def _pruned(v: Variant, score: dict[Variant, float]) -> bool:
    """Quick mode, over the instance count's variants measured so far (`score`: each one's best
    throughput within the limit): no longer queue delay once the last one did not beat the one before,
    no bigger max batch size once the last size's best did not beat the size's before it."""
    if v.queue_delay_us is None:
        return False
    same = [s for u, s in score.items() if (u.instances, u.max_batch_size) == (v.instances, v.max_batch_size)]
    if same:
        return len(same) >= 2 and not same[-1] > GAIN * same[-2]
    by_batch: dict[int, float] = {}
    for u, s in score.items():
        if u.instances == v.instances and u.max_batch_size < v.max_batch_size:
            by_batch[u.max_batch_size] = max(s, by_batch.get(u.max_batch_size, 0.0))
    sizes = sorted(by_batch)
    return len(sizes) >= 2 and not by_batch[sizes[-1]] > GAIN * by_batch[sizes[-2]]


# --- outputs ----------------------------------------------------------------------------------------

CSV_FIELDS = [
    "config", "instances", "max_batch_size", "dynamic_batching", "max_queue_delay_us", "concurrency",
    "throughput_infer_per_s", "latency_avg_ms", "latency_p50_ms", "latency_p90_ms", "latency_p95_ms",
    "latency_p99_ms", "server_queue_us", "server_compute_us", "avg_batch", "requests", "errors", "stable",
    "meets_limit",
]  # fmt: skip


def _csv_row(r: Row, limit_ms: float) -> dict[str, Any]:
    v, m = r.variant, r.m
    return {
        "config": v.name,
        "instances": v.instances,
        "max_batch_size": v.max_batch_size,
        "dynamic_batching": v.queue_delay_us is not None,
        "max_queue_delay_us": "" if v.queue_delay_us is None else v.queue_delay_us,
        "concurrency": m.concurrency,
        "throughput_infer_per_s": round(m.throughput, 3),
        "latency_avg_ms": round(m.latency_avg_ms, 3),
        "latency_p50_ms": round(m.latency_p50_ms, 3),
        "latency_p90_ms": round(m.latency_p90_ms, 3),
        "latency_p95_ms": round(m.latency_p95_ms, 3),
        "latency_p99_ms": round(m.latency_p99_ms, 3),
        "server_queue_us": round(m.server_queue_us, 1),
        "server_compute_us": round(m.server_compute_us, 1),
        "avg_batch": round(m.avg_batch, 2),
        "requests": m.requests,
        "errors": m.errors,
        "stable": m.stable,
        "meets_limit": r.meets(limit_ms),
    }


def best_config_text(cfg: TritonModelConfig, result: Result) -> str:
    best = result.best
    assert best is not None
    header = (
        f"tokenmill analyze: the highest throughput with p99 <= {result.spec.latency_limit_ms:g} ms\n"
        f"{best.m.throughput:.1f} infer/s, p99 {best.m.latency_p99_ms:.2f} ms at client concurrency "
        f"{best.m.concurrency} ({best.variant.label})"
    )
    return format_config(variant_config(cfg, best.variant), SCHEMA, header)


def write_outputs(result: Result, cfg: TritonModelConfig) -> dict[str, Path]:
    """results.csv, results.json, the plot and (when one met the limit) best/config.pbtxt."""
    spec, out = result.spec, result.spec.output_dir
    out.mkdir(parents=True, exist_ok=True)
    files = {"csv": out / "results.csv", "json": out / "results.json", "plot": out / "throughput_vs_p99.png"}
    with files["csv"].open("w", newline="") as f:
        w = csv.DictWriter(f, CSV_FIELDS)
        w.writeheader()
        w.writerows(_csv_row(r, spec.latency_limit_ms) for r in result.rows)
    best = out / "best" / "config.pbtxt"
    if result.best is not None:
        files["config"] = best
        best.parent.mkdir(exist_ok=True)
        best.write_text(best_config_text(cfg, result))
    else:  # a previous run's best is not this run's
        best.unlink(missing_ok=True)
    summary = {
        "model": spec.model,
        "repository": str(spec.repository),
        "latency_limit_ms": spec.latency_limit_ms,
        "quick": spec.quick,
        "load": asdict(spec.load),
        "results": [_csv_row(r, spec.latency_limit_ms) for r in result.rows],
        "failed": result.failed,
        "best": None if result.best is None else _csv_row(result.best, spec.latency_limit_ms),
        "remeasured": None
        if result.remeasured is None
        else {**result.remeasured.to_json(), "meets_limit": result.remeasured_meets},
        "remeasure_error": result.remeasure_error,
    }
    files["json"].write_text(json.dumps(summary, indent=2) + "\n")
    plot(result, files["plot"])
    return files


def plot(result: Result, path: Path) -> None:
    """Throughput against p99 latency, a line per configuration over its concurrencies, and the limit."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    limit = result.spec.latency_limit_ms
    fig, ax = plt.subplots(figsize=(10, 6))
    by_variant: dict[Variant, list[Row]] = {}
    for r in result.rows:
        by_variant.setdefault(r.variant, []).append(r)
    colors = plt.get_cmap("tab20").colors
    for i, (v, rows) in enumerate(by_variant.items()):
        rows.sort(key=lambda r: r.m.concurrency)
        ax.plot(
            [r.m.latency_p99_ms for r in rows],
            [r.m.throughput for r in rows],
            marker="o",
            ms=3,
            color=colors[i % len(colors)],
            ls=("-", "--", ":", "-.")[(v.instances - 1) % 4],  # the instance count, told apart in print
            label=v.label,
        )
    ax.axvline(limit, color="red", linestyle="--", label=f"p99 limit {limit:g} ms")
    if result.best is not None:
        b = result.best.m
        ax.plot(
            [b.latency_p99_ms],
            [b.throughput],
            marker="*",
            ms=16,
            color="gold",
            mec="black",
            ls="",
            label="best",
        )
    lat = [r.m.latency_p99_ms for r in result.rows] + [limit]
    if max(lat) / max(min(lat), 1e-3) > 30:
        ax.set_xscale("log")
    ax.set_xlabel("p99 latency (ms)")
    ax.set_ylabel("throughput (infer/s)")
    ax.set_title(f"tokenmill analyze: {result.spec.model}")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0), ncol=1 + len(by_variant) // 25)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
