"""Per-model statistics (the KServe statistics extension) and Triton's Prometheus metric names."""

from __future__ import annotations

import time
from collections import defaultdict
from dataclasses import dataclass, field

from prometheus_client import CollectorRegistry, Counter, Gauge

DURATIONS = ("success", "fail", "queue", "compute_input", "compute_infer", "compute_output")


@dataclass
class RequestTimes:
    """One request's compute times: its batch's, for a model; the sums of its steps', for an ensemble
    (Triton's way of timing an ensemble, whose own statistics add up what its steps computed)."""

    input_ns: int = 0
    infer_ns: int = 0
    output_ns: int = 0

    def add(self, other: RequestTimes) -> None:
        self.input_ns += other.input_ns
        self.infer_ns += other.infer_ns
        self.output_ns += other.output_ns


@dataclass
class _Duration:
    count: int = 0
    ns: int = 0

    def add(self, ns: int, n: int = 1) -> None:
        self.count += n
        self.ns += ns

    def to_json(self) -> dict:
        return {"count": self.count, "ns": self.ns}


class TritonMetrics:
    """Counters named as Triton's, labelled by model and version (one set for the whole server)."""

    def __init__(self, registry: CollectorRegistry) -> None:
        labels = ["model", "version"]

        def counter(name: str, doc: str, extra: list[str] | None = None) -> Counter:
            return Counter(name, doc, labels + (extra or []), registry=registry)

        self.success = counter("nv_inference_request_success", "Successful inference requests")
        self.failure = counter("nv_inference_request_failure", "Failed inference requests", ["reason"])
        self.count = counter("nv_inference_count", "Inferences performed (a batch of n counts n)")
        self.exec_count = counter("nv_inference_exec_count", "Model executions (batches)")
        self.request_us = counter(
            "nv_inference_request_duration_us", "Cumulative end-to-end request duration"
        )
        self.queue_us = counter("nv_inference_queue_duration_us", "Cumulative time requests waited in queue")
        self.input_us = counter("nv_inference_compute_input_duration_us", "Cumulative compute input duration")
        self.infer_us = counter("nv_inference_compute_infer_duration_us", "Cumulative compute infer duration")
        self.output_us = counter(
            "nv_inference_compute_output_duration_us", "Cumulative compute output duration"
        )
        self.pending = Gauge(
            "nv_inference_pending_request_count", "Requests waiting to execute", labels, registry=registry
        )
        self.ratio = Gauge(
            "tokenmill:model_queue_to_compute_ratio",
            "Queue time / compute time of a model over its lifetime (the autoscaling signal)",
            labels,
            registry=registry,
        )


@dataclass
class ModelStats:
    name: str
    version: str
    metrics: TritonMetrics | None = None
    durations: dict[str, _Duration] = field(default_factory=lambda: {k: _Duration() for k in DURATIONS})
    inference_count: int = 0
    execution_count: int = 0
    last_inference_ms: int = 0
    batch: dict[int, dict[str, _Duration]] = field(
        default_factory=lambda: defaultdict(
            lambda: {k: _Duration() for k in ("compute_input", "compute_infer", "compute_output")}
        )
    )
    pending: int = 0

    def enqueued(self) -> None:
        self.pending += 1
        if self.metrics:
            self.metrics.pending.labels(self.name, self.version).set(self.pending)

    def dequeued(self, queue_ns: int) -> None:
        self.pending -= 1
        self.durations["queue"].add(queue_ns)
        if self.metrics:
            self.metrics.pending.labels(self.name, self.version).set(self.pending)
            self.metrics.queue_us.labels(self.name, self.version).inc(queue_ns / 1e3)

    def executed(self, batch_size: int, input_ns: int, infer_ns: int, output_ns: int) -> None:
        self.execution_count += 1
        self.inference_count += batch_size
        self.last_inference_ms = int(time.time() * 1e3)
        for k, ns in (
            ("compute_input", input_ns),
            ("compute_infer", infer_ns),
            ("compute_output", output_ns),
        ):
            self.durations[k].add(ns)
            self.batch[batch_size][k].add(ns)
        m = self.metrics
        if m:
            lv = (self.name, self.version)
            m.exec_count.labels(*lv).inc()
            m.count.labels(*lv).inc(batch_size)
            m.input_us.labels(*lv).inc(input_ns / 1e3)
            m.infer_us.labels(*lv).inc(infer_ns / 1e3)
            m.output_us.labels(*lv).inc(output_ns / 1e3)
            compute = sum(self.durations[k].ns for k in ("compute_input", "compute_infer", "compute_output"))
            if compute:
                m.ratio.labels(*lv).set(self.durations["queue"].ns / compute)

    def ensemble_ran(self, batch_size: int, queue_ns: int, times: RequestTimes) -> None:
        """A successful ensemble request, counted as Triton counts one: a queue entry (the ensemble's own
        wait, before its first step), one execution of `batch_size` inferences, and the compute times
        of its steps. Tools read these: perf_analyzer takes the version whose queue count grew as the
        one it measured, and fails on an ensemble without one."""
        self.durations["queue"].add(queue_ns)
        if self.metrics:
            self.metrics.queue_us.labels(self.name, self.version).inc(queue_ns / 1e3)
        self.executed(batch_size, times.input_ns, times.infer_ns, times.output_ns)

    def finished(self, ok: bool, total_ns: int, reason: str = "OTHER") -> None:
        self.durations["success" if ok else "fail"].add(total_ns)
        if self.metrics:
            lv = (self.name, self.version)
            if ok:
                self.metrics.success.labels(*lv).inc()
            else:
                self.metrics.failure.labels(*lv, reason).inc()
            self.metrics.request_us.labels(*lv).inc(total_ns / 1e3)

    def to_json(self) -> dict:
        return {
            "name": self.name,
            "version": self.version,
            "last_inference": self.last_inference_ms,
            "inference_count": self.inference_count,
            "execution_count": self.execution_count,
            "inference_stats": {k: d.to_json() for k, d in self.durations.items()}
            | {"cache_hit": {"count": 0, "ns": 0}, "cache_miss": {"count": 0, "ns": 0}},
            "batch_stats": [
                {"batch_size": size, **{k: d.to_json() for k, d in ds.items()}}
                for size, ds in sorted(self.batch.items())
            ],
        }
