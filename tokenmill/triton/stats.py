"""Per-model statistics (the KServe statistics extension) and Triton's Prometheus metric names."""

from __future__ import annotations

import time
from collections import defaultdict
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry, Counter, Gauge
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

if TYPE_CHECKING:
    from tokenmill.triton.response_cache import ResponseCache

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
        # The response cache (triton/response_cache.py), per model as Triton names them; durations in
        # microseconds as Triton's: hit = look-up and copy out, miss = look-up and insertion.
        self.cache_hits = counter("nv_cache_num_hits_per_model", "Number of response cache hits per model")
        self.cache_misses = counter(
            "nv_cache_num_misses_per_model", "Number of response cache misses per model"
        )
        self.cache_hit_us = counter(
            "nv_cache_hit_duration_per_model",
            "Cumulative time requests spent retrieving a cached response on cache hits (us)",
        )
        self.cache_miss_us = counter(
            "nv_cache_miss_duration_per_model",
            "Cumulative time requests spent looking up and inserting responses on cache misses (us)",
        )
        self.registry = registry

    def watch_cache(self, cache: ResponseCache) -> None:
        """Also report the server-wide state of `cache` (a ResponseCache), under the names Triton's
        local cache uses."""
        self.registry.register(CacheCollector(cache))


class CacheCollector(Collector):
    """Server-wide gauges of the response cache, read at each scrape (Triton's local cache reports the
    same names, as gauges)."""

    def __init__(self, cache: ResponseCache) -> None:
        self.cache = cache

    def collect(self) -> Iterable[GaugeMetricFamily]:
        c = self.cache
        for name, doc, value in (
            ("nv_cache_util", "Response cache utilization [0.0 - 1.0]", c.utilization()),
            ("nv_cache_num_entries", "Entries in the response cache", len(c)),
            ("nv_cache_num_lookups", "Response cache lookups", c.hits + c.misses),
            ("nv_cache_num_hits", "Response cache hits", c.hits),
            ("nv_cache_num_misses", "Response cache misses", c.misses),
            ("nv_cache_num_evictions", "Response cache evictions", c.evictions),
            ("nv_cache_lookup_duration", "Total response cache lookup time (us)", c.lookup_ns / 1e3),
            ("nv_cache_insertion_duration", "Total response cache insertion time (us)", c.insert_ns / 1e3),
        ):
            yield GaugeMetricFamily(name, doc, value=value)


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
    cache_hits: _Duration = field(default_factory=_Duration)
    cache_misses: _Duration = field(default_factory=_Duration)

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

    def cache_hit(self, queue_ns: int, lookup_ns: int) -> None:
        """A request answered from the response cache. As Triton counts one: its wait before the
        look-up goes to `queue`, the look-up to `cache_hit`; no execution, inference or compute time.
        (`finished` counts it as a success.)"""
        self.durations["queue"].add(queue_ns)
        self.cache_hits.add(lookup_ns)
        self.last_inference_ms = int(time.time() * 1e3)
        if self.metrics:
            lv = (self.name, self.version)
            self.metrics.queue_us.labels(*lv).inc(queue_ns / 1e3)
            self.metrics.cache_hits.labels(*lv).inc()
            self.metrics.cache_hit_us.labels(*lv).inc(lookup_ns / 1e3)

    def cache_miss(self, ns: int) -> None:
        """A successful request the model computed after a cache miss: `ns` is its look-up plus the
        insertion of its outputs."""
        self.cache_misses.add(ns)
        if self.metrics:
            lv = (self.name, self.version)
            self.metrics.cache_misses.labels(*lv).inc()
            self.metrics.cache_miss_us.labels(*lv).inc(ns / 1e3)

    def to_json(self) -> dict:
        return {
            "name": self.name,
            "version": self.version,
            "last_inference": self.last_inference_ms,
            "inference_count": self.inference_count,
            "execution_count": self.execution_count,
            "inference_stats": {k: d.to_json() for k, d in self.durations.items()}
            | {"cache_hit": self.cache_hits.to_json(), "cache_miss": self.cache_misses.to_json()},
            "batch_stats": [
                {"batch_size": size, **{k: d.to_json() for k, d in ds.items()}}
                for size, ds in sorted(self.batch.items())
            ],
        }
