"""Prometheus metrics, computed in the frontend from engine timestamps (the engine loop stays lean).

Names follow vLLM's with a `tokenmill:` prefix, so existing dashboards need only a rename. The
queue-to-compute ratio is the source documents' autoscaling signal: queue time divided by compute
time, here over the requests that finished in the last `window_s` seconds.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Iterator

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from tokenmill.engine.client import EngineClient
from tokenmill.outputs import RequestOutput

LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.25, 0.5, 0.75, 1, 2.5, 5, 7.5, 10, 20, 40, 80)
ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.03, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 1, 2.5)


# Bands (priorities) past these count under the nearest one, so that no client grows the label set.
BAND_LABEL_RANGE = (-10, 10)


def band_label(band: int) -> str:
    lo, hi = BAND_LABEL_RANGE
    return str(min(max(band, lo), hi))


class Metrics:
    def __init__(self, client: EngineClient, model_name: str, window_s: float = 60.0) -> None:
        self.registry = CollectorRegistry()
        self.model = model_name
        self.window_s = window_s
        self._recent: deque[tuple[float, float, float]] = deque()  # (finished at, queue s, compute s)
        # (finished at, output tokens, TTFT s or None, mean inter-token s or None): what the planner reads.
        self._latencies: deque[tuple[float, int, float | None, float | None]] = deque(maxlen=100_000)
        labels = ["model_name"]
        r = self.registry
        self.success = Counter(
            "tokenmill:request_success",
            "Finished requests by reason",
            [*labels, "finished_reason"],
            registry=r,
        )
        self.failure = Counter(
            "tokenmill:request_failure", "Requests that failed", [*labels, "kind"], registry=r
        )
        # Requests shed under overload for a more urgent one (server/admission.py), by band (priority).
        self.shed = Counter(
            "tokenmill:requests_shed",
            "Queued requests shed under overload for more urgent ones, by band (priority)",
            [*labels, "band"],
            registry=r,
        )
        self.prompt_tokens = Counter("tokenmill:prompt_tokens", "Prompt tokens processed", labels, registry=r)
        self.generation_tokens = Counter(
            "tokenmill:generation_tokens", "Tokens generated", labels, registry=r
        )

        def hist(name: str, doc: str, buckets: tuple[float, ...] = LATENCY_BUCKETS) -> Histogram:
            return Histogram(name, doc, labels, buckets=buckets, registry=r)

        self.ttft = hist("tokenmill:time_to_first_token_seconds", "Arrival to first token")
        self.itl = hist(
            "tokenmill:inter_token_latency_seconds", "Gap between consecutive tokens", ITL_BUCKETS
        )
        self.e2e = hist("tokenmill:e2e_request_latency_seconds", "Arrival to last token")
        self.queue = hist("tokenmill:request_queue_time_seconds", "Arrival to first scheduling")
        self.prefill = hist("tokenmill:request_prefill_time_seconds", "First scheduling to first token")
        self.decode = hist("tokenmill:request_decode_time_seconds", "First token to last token")
        r.register(_EngineCollector(client, self))

    def observe(self, ro: RequestOutput) -> None:
        """Record a finished request (all its sequences)."""
        self.prompt_tokens.labels(self.model).inc(len(ro.prompt_token_ids))
        now = time.monotonic()
        for o in ro.outputs:
            self.success.labels(self.model, o.finish_reason or "abort").inc()
            self.generation_tokens.labels(self.model).inc(len(o.token_ids))
            m = o.metrics
            if m is None or m.first_scheduled_time is None:
                continue
            queue = m.first_scheduled_time - m.arrival_time
            self.queue.labels(self.model).observe(queue)
            end = m.finished_time or now
            if m.first_token_time is not None:
                self.ttft.labels(self.model).observe(m.first_token_time - m.arrival_time)
                self.prefill.labels(self.model).observe(m.first_token_time - m.first_scheduled_time)
                self.decode.labels(self.model).observe(end - m.first_token_time)
            self.e2e.labels(self.model).observe(end - m.arrival_time)
            for a, b in zip(m.token_times, m.token_times[1:], strict=False):
                self.itl.labels(self.model).observe(b - a)
            self._recent.append((now, queue, end - m.first_scheduled_time))
            ttft = m.first_token_time - m.arrival_time if m.first_token_time is not None else None
            n = len(o.token_ids)
            itl = (end - m.first_token_time) / (n - 1) if m.first_token_time is not None and n > 1 else None
            self._latencies.append((now, n, ttft, itl))

    def observe_aborted(self, sequences: int) -> None:
        self.success.labels(self.model, "abort").inc(sequences)

    def observe_failure(self, kind: str) -> None:
        self.failure.labels(self.model, kind).inc()

    def observe_shed(self, band: int) -> None:
        self.shed.labels(self.model, band_label(band)).inc()

    def latency_window(self, window_s: float) -> dict[str, float | None]:
        """Over requests finished in the last `window_s`: mean output tokens and p95 TTFT and ITL (per
        request: (end - first token) / (tokens - 1)); None where there were none."""
        cutoff = time.monotonic() - window_s
        recent = [r for r in self._latencies if r[0] >= cutoff]

        def p95(xs: list[float]) -> float | None:
            return sorted(xs)[min(int(0.95 * len(xs)), len(xs) - 1)] if xs else None

        return {
            "finished": len(recent),
            "mean_osl": sum(r[1] for r in recent) / len(recent) if recent else None,
            "ttft_p95_s": p95([r[2] for r in recent if r[2] is not None]),
            "itl_p95_s": p95([r[3] for r in recent if r[3] is not None]),
        }

    def queue_to_compute_ratio(self, window_s: float | None = None) -> float:
        """Over requests finished in the last `window_s` (default: the metrics window)."""
        now = time.monotonic()
        cutoff = now - self.window_s
        while self._recent and self._recent[0][0] < cutoff:
            self._recent.popleft()
        since = now - (window_s if window_s is not None else self.window_s)
        recent = [(q, c) for t, q, c in self._recent if t >= since]
        compute = sum(c for _, c in recent)
        return sum(q for q, _ in recent) / compute if compute > 0 else 0.0

    def render(self) -> bytes:
        return generate_latest(self.registry)


class _EngineCollector(Collector):
    """Engine-side state, read from the latest stats the engine process sent."""

    def __init__(self, client: EngineClient, metrics: Metrics) -> None:
        self.client, self.metrics = client, metrics

    # The KV connector's families: (metric, help, kind, label name or None, {label value: counter key}).
    # A family appears only when some worker reports one of its counters (offload tiers or KV transfer).
    _CONNECTOR = (
        ("tokenmill:kv_offload_loaded_blocks", "KV blocks loaded into the pool, by the tier they came from",
         "counter", "tier", {"host": "host_loads", "disk": "disk_hits", "shared": "shared_hits"}),
        ("tokenmill:kv_offload_saved_blocks", "KV blocks written to a tier (file: disk, else shared)",
         "counter", "tier", {"host": "host_saved_blocks", "file": "file_writes"}),
        ("tokenmill:kv_offload_corrupt_blocks", "Offloaded KV blocks found damaged or stale (recomputed)",
         "counter", None, {"": "corrupt_blocks"}),
        ("tokenmill:kv_offload_load_failures", "Background loads cut short by a missing or bad block",
         "counter", None, {"": "file_load_failures"}),
        ("tokenmill:kv_offload_host_blocks", "KV blocks held in the host tier", "gauge", None,
         {"": "host_blocks"}),
        ("tokenmill:kv_transfer_read_blocks", "KV blocks read from prefill workers, by how they came",
         "counter", "path", {"shm": "blocks_read_shm", "tcp": "blocks_read_tcp"}),
        ("tokenmill:kv_transfer_read_failures", "Reads from prefill workers that failed (recomputed)",
         "counter", None, {"": "remote_read_failures"}),
        ("tokenmill:kv_transfer_mismatched_prompts", "Remote prefills not read: their blocks were of another "
         "prompt (recomputed)", "counter", None, {"": "remote_load_mismatches"}),
        ("tokenmill:kv_transfer_served_blocks", "KV blocks sent to decode workers over TCP (shared-memory "
         "readers copy directly)", "counter", None, {"": "blocks_served"}),
        ("tokenmill:kv_transfer_held_requests", "Finished prefills whose blocks wait for their reader",
         "gauge", None, {"": "held_now"}),
    )  # fmt: skip

    @staticmethod
    def _connector(names: list[str], series: list) -> Iterator[Metric]:  # type: ignore[type-arg]
        stats = [(labels, st.kv_connector) for labels, st in series if st is not None and st.kv_connector]
        for name, doc, kind, label, keys in _EngineCollector._CONNECTOR:
            if not any(k in kv for _, kv in stats for k in keys.values()):
                continue
            cls = CounterMetricFamily if kind == "counter" else GaugeMetricFamily
            f = cls(name, doc, labels=[*names, label] if label else names)
            for labels, kv in stats:
                for value, key in keys.items():
                    f.add_metric([*labels, value] if label else labels, kv.get(key, 0))
            yield f

    def collect(self):
        m = self.metrics.model
        # A fleet's engine metrics carry a `worker` label, one series per worker (sum them for the
        # fleet); a single engine's carry the model name alone.
        per_worker = getattr(self.client, "worker_stats", None)
        if per_worker is not None:
            names = ["model_name", "worker"]
            series = [([m, url], st) for url, st in per_worker().items()]
        else:
            names = ["model_name"]
            series = [([m], self.client.stats)]

        def gauge(name: str, doc: str, value) -> GaugeMetricFamily:  # noqa: ANN001 - stats -> number
            g = GaugeMetricFamily(name, doc, labels=names)
            for labels, st in series:
                g.add_metric(labels, value(st) if st else 0)
            return g

        def counter(name: str, doc: str, value) -> CounterMetricFamily:  # noqa: ANN001
            c = CounterMetricFamily(name, doc, labels=names)
            for labels, st in series:
                c.add_metric(labels, value(st) if st else 0)
            return c

        # The gauges gateway schedulers read (llm-d's inference scheduler, the Gateway API Inference
        # Extension's model-server protocol) go out under vLLM's names too: same values, same labels. No
        # `engine` label: vllm-router counts its values as data-parallel ranks.
        for name, doc, value in (
            ("num_requests_running", "Requests in the running batch", lambda s: s.num_running),
            ("num_requests_waiting", "Requests waiting for the engine", lambda s: s.num_waiting),
            ("kv_cache_usage_perc", "Fraction of KV blocks in use, 0 to 1", lambda s: s.kv_cache_usage),
        ):
            yield gauge(f"tokenmill:{name}", doc, value)
            yield gauge(f"vllm:{name}", f"{doc} (vLLM's name)", value)
        yield gauge("tokenmill:kv_cache_blocks", "KV blocks in the pool", lambda s: s.num_blocks)
        cache_info = GaugeMetricFamily(
            "vllm:cache_config_info", "The KV cache's configuration (vLLM's name; value 1)",
            labels=[*names, "block_size", "num_gpu_blocks"],
        )  # fmt: skip
        block_size = str(self.client.info.get("block_size", ""))
        for labels, st in series:
            cache_info.add_metric([*labels, block_size, str(st.num_blocks if st else 0)], 1)
        yield cache_info
        yield gauge(
            "tokenmill:kv_cache_blocks_in_use",
            "KV blocks held by requests",
            lambda s: round(s.kv_cache_usage * s.num_blocks),
        )
        yield counter(
            "tokenmill:prefix_cache_queries", "Prompt tokens looked up", lambda s: s.prefix_cache_queries
        )
        yield counter(
            "tokenmill:prefix_cache_hits", "Prompt tokens found cached", lambda s: s.prefix_cache_hits
        )
        yield counter("tokenmill:num_preemptions", "Requests preempted", lambda s: s.num_preemptions)
        # Steps that computed something: the engine's own clock (what tokens per step are counted in).
        yield counter("tokenmill:engine_steps", "Engine steps run", lambda s: s.num_steps)
        # One fewer than the configured count while a neighbour crowds the cores (thread_governor.py).
        yield gauge(
            "tokenmill:engine_threads",
            "Threads the engine's forward passes use now (0: not reported)",
            lambda s: s.engine_threads,
        )
        yield counter(
            "tokenmill:engine_thread_changes",
            "Changes of the engine's thread count by its governor",
            lambda s: s.engine_thread_changes,
        )
        # Speculative decoding (vLLM's spec_decode_* family): acceptance rate = accepted / draft
        # tokens; mean accepted length = 1 + accepted / drafts.
        yield counter("tokenmill:spec_decode_num_drafts", "Drafts verified", lambda s: s.spec_num_drafts)
        yield counter(
            "tokenmill:spec_decode_num_draft_tokens",
            "Draft tokens verified",
            lambda s: s.spec_num_draft_tokens,
        )
        yield counter(
            "tokenmill:spec_decode_num_accepted_tokens",
            "Draft tokens accepted",
            lambda s: s.spec_num_accepted_tokens,
        )
        per_pos = CounterMetricFamily(
            "tokenmill:spec_decode_num_accepted_tokens_per_pos",
            "Draft tokens accepted, by position in the draft (0 = first)",
            labels=[*names, "position"],
        )
        for labels, st in series:
            for pos, n in enumerate(st.spec_accepted_per_pos if st else []):
                per_pos.add_metric([*labels, str(pos)], n)
        yield per_pos
        # vLLM's lora_requests_info (what llm-d's LoRA affinity reads): the adapters running requests,
        # those resident in the slots, and the slots; the value is when it was read, as vLLM's.
        if any(st and st.lora_slots for _, st in series):
            info = GaugeMetricFamily(
                "tokenmill:lora_requests_info",
                "LoRA adapters running requests and resident in the slots",
                labels=[*names, "running_lora_adapters", "resident_lora_adapters", "max_lora"],
            )
            # vLLM's own family, as llm-d reads it (the adapters of waiting requests are not reported here:
            # that label is empty).
            vinfo = GaugeMetricFamily(
                "vllm:lora_requests_info", "LoRA adapters running requests (vLLM's name)",
                labels=[*names, "max_lora", "waiting_lora_adapters", "running_lora_adapters"],
            )  # fmt: skip
            for labels, st in series:
                if st and st.lora_slots:
                    running, resident = ",".join(st.lora_running), ",".join(st.lora_resident)
                    info.add_metric([*labels, running, resident, str(st.lora_slots)], time.time())
                    vinfo.add_metric([*labels, str(st.lora_slots), "", running], time.time())
            yield info
            yield vinfo
        yield from self._connector(names, series)
        # What each tenant was served (the engine's counts: prompt tokens as computed, generated tokens):
        # the shares the fair policy keeps, and what any other policy gave. The engine bounds the names
        # (engine/fairness.py TenantLedger): the configured ones, 256 more, default and other.
        tenants = CounterMetricFamily(
            "tokenmill:tenant_tokens",
            "Tokens served per tenant: input (prompt tokens computed) and output (tokens generated)",
            labels=[*names, "tenant", "kind"],
        )
        for labels, st in series:
            for tenant, (n_in, n_out) in sorted((st.tenant_tokens if st else {}).items()):
                tenants.add_metric([*labels, tenant, "input"], n_in)
                tenants.add_metric([*labels, tenant, "output"], n_out)
        yield tenants
        router_metrics = getattr(self.client, "router_metrics", None)
        if router_metrics is not None:
            yield from router_metrics(m)
        for name, doc, value in (
            (
                "tokenmill:queue_to_compute_ratio",
                f"Queue time / compute time of requests finished in the last {self.metrics.window_s:.0f}s",
                self.metrics.queue_to_compute_ratio(),
            ),
            (
                "tokenmill:engine_healthy",
                "1 while the engine process (any worker of a fleet) answers",
                1.0 if self.client.healthy else 0.0,
            ),
        ):
            g = GaugeMetricFamily(name, doc, labels=["model_name"])
            g.add_metric([m], value)
            yield g
