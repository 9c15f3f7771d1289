"""The console's live figures: one JSON snapshot, computed when the page asks (about once a second while a
console is open) and never otherwise, so an unwatched server pays nothing for it.

Counters are cumulative (the page differentiates two snapshots into rates, as Prometheus' rate() does);
latencies are percentiles over the requests that finished in the last `window_s` seconds, read from the
per-request records Metrics keeps for the planner. Nothing here names a file, a socket or the API key:
the engine's reasons are passed through the same scrubbing as client-facing errors.
"""

from __future__ import annotations

import math
import time
from typing import Any

from prometheus_client import Counter

from tokenmill.server.errors import engine_unavailable
from tokenmill.server.metrics import Metrics

DEFAULT_WINDOW_S = 30.0
PERCENTILES = (50, 90, 99)
# The KV connector's counters of blocks loaded back into the pool, by the tier they came from (the same
# keys the /metrics family tokenmill:kv_offload_loaded_blocks reads).
OFFLOAD_TIERS = {"host": "host_loads", "disk": "disk_hits", "shared": "shared_hits"}


def percentiles(values: list[float]) -> dict[str, float | None]:
    """Nearest-rank p50/p90/p99 (None without values): the value below which that share of requests fell."""
    xs = sorted(values)
    out: dict[str, float | None] = {}
    for p in PERCENTILES:
        out[f"p{p}"] = xs[max(math.ceil(p / 100 * len(xs)) - 1, 0)] if xs else None
    return out


def counter_totals(counter: Counter, label: str | None = None) -> dict[str, float]:
    """A prometheus Counter's current totals through its public collect(): by the values of `label`, or
    one total under "" without it."""
    totals: dict[str, float] = {}
    for family in counter.collect():
        for sample in family.samples:
            if not sample.name.endswith("_total"):
                continue  # the `_created` timestamps
            key = sample.labels.get(label, "") if label else ""
            totals[key] = totals.get(key, 0.0) + sample.value
    return totals


def latency_window(metrics: Metrics, window_s: float) -> dict[str, Any]:
    """TTFT, ITL (per request: (end - first token) / (tokens - 1), as `tokenmill bench` counts it) and
    end-to-end percentiles, in seconds, over requests finished in the last `window_s`.

    Reads Metrics' own records of finished requests (newest last), from the newest back to the cut-off:
    the cost follows the window's requests, not the records' bound."""
    cutoff = time.monotonic() - window_s
    ttft: list[float] = []
    itl: list[float] = []
    finished = 0
    for at, _tokens, first, gap in reversed(metrics._latencies):  # noqa: SLF001 - read-only
        if at < cutoff:
            break
        finished += 1
        if first is not None:
            ttft.append(first)
        if gap is not None:
            itl.append(gap)
    e2e: list[float] = []
    for at, queue, compute in reversed(metrics._recent):  # noqa: SLF001 - read-only
        if at < cutoff:
            break
        e2e.append(queue + compute)  # arrival to first scheduling, then to the last token
    return {
        "window_s": window_s,
        "finished": finished,
        "ttft_s": percentiles(ttft),
        "itl_s": percentiles(itl),
        "e2e_s": percentiles(e2e),
    }


def engine_state(client: Any, draining: bool) -> dict[str, Any]:  # noqa: ANN401 - any EngineClient
    healthy = bool(client.healthy)
    reason = None
    if not healthy:
        # The reasons the engine client records name its socket and files: scrubbed as clients see them.
        reason = engine_unavailable(getattr(client, "dead_reason", None) or "not answering")
    return {"healthy": healthy, "reason": reason, "draining": draining}


def cache_counters(stats: Any) -> dict[str, Any]:  # noqa: ANN401 - EngineStats or None
    connector = dict(getattr(stats, "kv_connector", None) or {})
    return {
        "prefix_cache_queries": getattr(stats, "prefix_cache_queries", 0),
        "prefix_cache_hits": getattr(stats, "prefix_cache_hits", 0),
        "preemptions": getattr(stats, "num_preemptions", 0),
        # Only the tiers this engine has: an empty object says there are no offload tiers.
        "offload_loaded_blocks": {
            tier: connector[key] for tier, key in OFFLOAD_TIERS.items() if key in connector
        },
    }


def engine_counters(client: Any, worker_name: Any) -> dict[str, dict[str, Any]]:  # noqa: ANN401
    """The engine-side counters of each engine, keyed by which engine and which of its lives: the page
    takes differences per key, so a fleet whose workers come and go (a restart's counters start again, a
    joining worker brings its lifetime totals) shows no false spikes."""
    workers = getattr(client, "workers", None)
    if workers is None or getattr(client, "worker_stats", None) is None:
        return {"engine": cache_counters(client.stats)}
    out = {}
    for w in list(workers):
        wc = getattr(w, "client", None)
        if getattr(w, "up", False) and not getattr(w, "retired", False) and wc is not None:
            out[f"{worker_name(w)}#{getattr(w, 'joins', 0)}"] = cache_counters(wc.stats)
    return out


def load_now(stats: Any, in_flight: int) -> dict[str, Any]:  # noqa: ANN401 - EngineStats or None
    return {
        "running": getattr(stats, "num_running", 0),
        "waiting": getattr(stats, "num_waiting", 0),
        "kv_usage": getattr(stats, "kv_cache_usage", 0.0),
        "kv_blocks": getattr(stats, "num_blocks", 0),
        "in_flight": in_flight,  # sequences admitted by this server (those the engine has not seen too)
    }


def request_counters(metrics: Metrics) -> dict[str, Any]:
    return {
        "output_tokens": counter_totals(metrics.generation_tokens).get("", 0.0),
        "prompt_tokens": counter_totals(metrics.prompt_tokens).get("", 0.0),
        "finished": counter_totals(metrics.success, "finished_reason"),
        "failures": counter_totals(metrics.failure, "kind"),
    }
