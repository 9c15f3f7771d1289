"""Aggregates of a run: distributions, throughputs, SLOs and goodput.

Conventions, stated in every summary.json:
- percentiles by numpy's linear interpolation, std the population std (np.std), as GenAI-Perf and vLLM;
- benchmark duration = last response - first send over the measured (non-warm-up) requests, as AIPerf;
- goodput = requests that meet every SLO / duration, each request checked on its own record; a request
  without a value for an SLO metric (e.g. one output token, so no ITL) does not meet it.
"""

from __future__ import annotations

import re
from collections import Counter
from dataclasses import dataclass
from typing import Any

import numpy as np

from tokenmill.bench.records import RequestRecord

PERCENTILES = (50, 90, 95, 99)
LATENCY_METRICS = ("ttft", "ttst", "itl", "e2e")


def describe(values: list[float]) -> dict[str, float] | None:
    """mean, min, max, std and p50/p90/p95/p99 of the values; None when there are none."""
    if not values:
        return None
    a = np.asarray(values, dtype=np.float64)
    out = {"mean": float(a.mean()), "min": float(a.min()), "max": float(a.max()), "std": float(a.std())}
    for p in PERCENTILES:
        out[f"p{p}"] = float(np.percentile(a, p))
    return out


@dataclass(frozen=True)
class Slo:
    """One service-level objective on a per-request metric: latencies at most, throughputs at least."""

    metric: str  # ttft | ttst | itl | e2e (milliseconds) | tps_user (tokens/s)
    limit: float

    def met_by(self, r: RequestRecord) -> bool:
        if self.metric == "tps_user":
            v = r.tps_user
            return v is not None and v >= self.limit
        v = r.metric_ms(self.metric)
        return v is not None and v <= self.limit

    def __str__(self) -> str:
        unit = " tok/s" if self.metric == "tps_user" else " ms"
        cmp = ">=" if self.metric == "tps_user" else "<="
        return f"{self.metric} {cmp} {self.limit:g}{unit}"


_UNITS = {"ms": 1.0, "s": 1e3, "us": 1e-3}


def parse_slos(text: str | None) -> list[Slo]:
    """Parse 'ttft=500ms,itl=50ms,e2e=2s,tps_user=20'. Raises ValueError with what to change."""
    if not text:
        return []
    slos = []
    for part in text.split(","):
        name, sep, value = part.strip().partition("=")
        name = name.strip().lower()
        if not sep or not value.strip():
            raise ValueError(f"SLO {part.strip()!r} is not NAME=VALUE (e.g. ttft=500ms)")
        if name == "tps_user":
            try:
                slos.append(Slo(name, float(value)))
            except ValueError:
                raise ValueError(f"tps_user SLO {value!r} is not a number of tokens/s") from None
            continue
        if name not in LATENCY_METRICS:
            raise ValueError(f"unknown SLO metric {name!r}: use ttft, ttst, itl, e2e or tps_user")
        m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*(ms|s|us)?\s*", value)
        if not m:
            raise ValueError(f"SLO value {value!r} for {name} is not a time like 500ms or 2s")
        slos.append(Slo(name, float(m.group(1)) * _UNITS[m.group(2) or "ms"]))
    return slos


def meets_all(r: RequestRecord, slos: list[Slo]) -> bool:
    return r.ok and all(s.met_by(r) for s in slos)


def summarize(records: list[RequestRecord], slos: list[Slo]) -> dict[str, Any]:
    """The summary.json metrics of one run (warm-up records are left out here)."""
    # Requests cut off at the end of a duration-bounded level are neither successes nor failures.
    cancelled = sum(1 for r in records if not r.warmup and r.error == "cancelled")
    measured = [r for r in records if not r.warmup and r.error != "cancelled"]
    ok = [r for r in measured if r.ok]
    failed = [r for r in measured if not r.ok]
    if measured:
        t0 = min(r.t_send for r in measured)
        t1 = max((r.t_end for r in measured if r.t_end is not None), default=t0)
        duration = max(t1 - t0, 1e-9)
    else:
        duration = 0.0
    out: dict[str, Any] = {}
    for name in LATENCY_METRICS:
        vals = [v for r in ok if (v := r.metric_ms(name)) is not None]
        out[f"{name}_ms"] = describe(vals)
    out["chunk_gap_ms"] = describe([g * 1e3 for r in ok for g in r.chunk_gaps_s])
    out["tps_user"] = describe([v for r in ok if (v := r.tps_user) is not None])
    out["isl"] = describe([r.isl for r in ok if r.isl is not None])
    out["osl"] = describe([r.osl for r in ok if r.osl is not None])
    out_tokens = sum(r.osl or 0 for r in ok)
    in_tokens = sum(r.isl or 0 for r in ok)
    good = sum(1 for r in ok if meets_all(r, slos))
    arrival, completion = _rates(measured, ok)
    per_s = (lambda n: n / duration) if duration else (lambda n: 0.0)
    out.update(
        {
            "completed": len(ok),
            "failed": len(failed),
            "cancelled_at_end": cancelled,
            "errors": dict(Counter(r.error or "incomplete" for r in failed)),
            "duration_s": duration,
            "request_throughput": per_s(len(ok)),
            "output_token_throughput": per_s(out_tokens),
            "input_token_throughput": per_s(in_tokens),
            "total_output_tokens": out_tokens,
            "total_input_tokens": in_tokens,
            "slos": [str(s) for s in slos],
            "good_requests": good,
            "goodput": per_s(good),
            "slo_attainment": good / len(measured) if measured else 0.0,
            "osl_sources": dict(Counter(r.osl_source for r in ok)),
            "arrival_rate": arrival,
            "completion_rate": completion,
            "conventions": {
                "percentiles": "numpy linear interpolation; std is the population std",
                "duration": "last response - first send of the measured requests",
                "itl": "(e2e - ttft) / (output tokens - 1), per request (vLLM calls it TPOT)",
                "chunk_gap": "time between consecutive non-empty streamed chunks, pooled (vLLM's ITL)",
                "goodput": "requests meeting every SLO / duration; slo_attainment = good / measured",
                "arrival_rate": "(sent - 1) / (last send - first send)",
                "completion_rate": "(completed - 1) / (last completion - first completion); below the "
                "arrival rate, the server did not keep up and its queue was growing",
            },
        }
    )
    return out


def _rates(measured: list[RequestRecord], ok: list[RequestRecord]) -> tuple[float | None, float | None]:
    """Requests/s sent and completed, each over its own span, free of the run's start and end effects."""

    def rate(times: list[float]) -> float | None:
        span = max(times) - min(times) if len(times) > 1 else 0.0
        return (len(times) - 1) / span if span > 0 else None

    return rate([r.t_send for r in measured]), rate([r.t_end for r in ok if r.t_end is not None])
