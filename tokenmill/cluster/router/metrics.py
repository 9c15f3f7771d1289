"""The router's own counts, and their Prometheus families (decisions, overlap credited, retries,
workers up and down, KV-event gaps)."""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric

if TYPE_CHECKING:
    from tokenmill.cluster.router.client import RouterEngineClient


@dataclass
class RouterStats:
    decisions: Counter = field(default_factory=Counter)  # by policy
    overlap_blocks: int = 0  # prompt blocks credited as already held by the chosen worker
    request_blocks: int = 0
    retries: int = 0
    worker_losses: int = 0
    disaggregated: int = 0  # requests whose prompt a prefill worker computed
    disagg_fallbacks: int = 0  # ... that was tried and failed: the decode worker computed it
    drains: int = 0  # workers the router drained (scaled down, or gone from discovery)
    drain_requests: int = 0  # requests those workers had when their drain began (left to finish there)


def single(kind: type, name: str, doc: str, model: str, value: float) -> Metric:
    """A family of one series, labelled by the model only."""
    fam = kind(f"tokenmill:{name}", doc, labels=["model_name"])
    fam.add_metric([model], value)
    return fam


def router_metrics(router: RouterEngineClient, model: str) -> Iterator[Metric]:
    st = router.stats_router
    d = CounterMetricFamily(
        "tokenmill:router_decisions", "Routing decisions, by policy", labels=["model_name", "policy"]
    )
    for policy, n in sorted(st.decisions.items()):
        d.add_metric([model, policy], n)
    yield d
    for name, doc, value, kind in (
        ("router_overlap_blocks", "Prompt blocks the chosen worker already held", st.overlap_blocks, 0),
        ("router_request_blocks", "Prompt blocks routed", st.request_blocks, 0),
        ("router_retries", "Requests sent again after their worker was lost", st.retries, 0),
        ("router_worker_losses", "Times a worker left rotation", st.worker_losses, 0),
        ("router_disaggregated", "Requests prefilled on a prefill worker", st.disaggregated, 0),
        ("router_disagg_fallbacks", "Remote prefills that failed (computed locally)", st.disagg_fallbacks, 0),
        ("router_drains", "Workers drained out of the fleet (scale-down, discovery)", st.drains, 0),
        (
            "router_drain_requests",
            "Requests on workers when their drain began (each finishes where it runs)",
            st.drain_requests,
            0,
        ),
        ("router_workers_up", "Workers in rotation", router.num_up, 1),
        ("router_workers_answering", "Workers heard from within the last second", router.num_answering, 1),
        ("router_indexed_blocks", "Distinct KV blocks in the router's index", router.indexed_blocks, 1),
        (
            "router_index_orphan_blocks",
            "Stored blocks the index could not place (parent unknown: events lost or reordered)",
            getattr(router.prefix.events, "orphans", 0),
            0,
        ),
    ):
        fam = (CounterMetricFamily if kind == 0 else GaugeMetricFamily)(
            f"tokenmill:{name}", doc, labels=["model_name"]
        )
        fam.add_metric([model], value)
        yield fam
    # Which worker is down (the counts above say only how many): one series per worker of the fleet,
    # with its role in a disaggregated one.
    up = GaugeMetricFamily(
        "tokenmill:router_worker_up",
        "1 while the worker is in rotation, 0 while it is down, draining or joining",
        labels=["model_name", "worker", "role"],
    )
    for w in router.workers:
        if not w.retired:
            up.add_metric([model, w.name, w.role or ""], 1.0 if w.serving() else 0.0)
    yield up
    ev = CounterMetricFamily(
        "tokenmill:router_kv_event_gaps",
        "Gaps in a worker's KV-event stream, by outcome",
        labels=["model_name", "worker", "outcome"],
    )
    for w in router.workers:
        if w.subscriber is not None:
            sst = w.subscriber.stats
            ev.add_metric([model, w.name, "seen"], sst.gaps)
            ev.add_metric([model, w.name, "lost"], sst.lost)
    yield ev
    fq = router.fleet_queue
    if fq is not None:  # --router-queue: requests waiting at the router while every worker is full
        wait = "Requests waiting at the router for a place (every worker full)"
        yield single(GaugeMetricFamily, "router_queue_waiting", wait, model, len(fq))
        held = "Requests that waited at the router for a place"
        yield single(CounterMetricFamily, "router_queue_held", held, model, fq.stats.held)
        released = "Requests sent on after waiting at the router"
        yield single(CounterMetricFamily, "router_queue_released", released, model, fq.stats.released)
        waited = "Seconds the released requests waited at the router"
        yield single(CounterMetricFamily, "router_queue_wait_seconds", waited, model, fq.stats.wait_sum)
    cs = router.cold_start
    if cs is not None:  # a fleet that scales to zero: requests waiting for a worker to start
        doc = "Requests waiting for a worker to start (no worker in rotation)"
        yield single(GaugeMetricFamily, "router_cold_start_waiting", doc, model, len(cs))
        c = CounterMetricFamily(
            "tokenmill:router_cold_start_requests",
            "Requests that found no worker in rotation, by outcome (served after waiting, timed out, "
            "refused over the waiting bound)",
            labels=["model_name", "outcome"],
        )
        for outcome, n in (("served", cs.stats.served), ("timed_out", cs.stats.timed_out),
                           ("refused", cs.stats.refused)):  # fmt: skip
            c.add_metric([model, outcome], n)
        yield c
        h = HistogramMetricFamily(
            "tokenmill:router_cold_start_wait_seconds",
            "How long served requests waited for a worker to start",
            labels=["model_name"],
        )
        h.add_metric([model], cs.stats.buckets(), cs.stats.wait_sum)
        yield h
