"""OpenTelemetry traces, sent as OTLP over HTTP/protobuf with the official SDK (the `tracing` extra).

Off unless `--otlp-traces-endpoint` names a collector; then each process that handles a request sends
its own spans there, linked by W3C trace context:

- the HTTP front: one SERVER span per request (`POST /v1/chat/completions`), a child of the client's
  `traceparent` header when it sends one;
- the router of a fleet: one `route` span per dispatch (a retry is a second one), naming the worker
  and the prefix blocks credited there;
- the engine (its own process, or a worker's): one `llm_request` span per sequence, started when the
  engine received it, with `queue`, `kv_load`, `prefill` and `decode` children, and the counts the
  engine knows (cached and loaded blocks, preemptions, tokens) as attributes.

The context crosses the engine protocol as plain data: `EngineRequest.trace_context`, the
`traceparent` (and `tracestate`) of the span the engine's span hangs from.

Engine timestamps are `time.monotonic()`; spans are stamped in wall-clock nanoseconds by the offset
between the two clocks read once per span. Nothing here runs when tracing is off: the SDK is imported
by `init` only.
"""

from __future__ import annotations

import os
import re
import time
from contextvars import ContextVar
from typing import Any

from tokenmill.extras import require

# The trace context a carrier may hold: W3C's two headers, checked here (anyone may send them: a
# malformed one is dropped before the SDK, which would log a warning for each).
CARRIER_KEYS = ("traceparent", "tracestate")
MAX_CARRIER_VALUE = 512
TRACEPARENT = re.compile(r"[0-9a-f]{2}-[0-9a-f]{32}-[0-9a-f]{16}-[0-9a-f]{2}")
TRACESTATE_MEMBER = re.compile(
    r"[a-z0-9][a-z0-9_\-*/]{0,255}(@[a-z][a-z0-9_\-*/]{0,13})?=[\x20-\x2b\x2d-\x3c\x3e-\x7e]{0,255}[\x21-\x2b\x2d-\x3c\x3e-\x7e]"
)
MAX_TRACESTATE_MEMBERS = 32

_tracer: Any = None  # an SDK Tracer once init() ran
_provider: Any = None
_propagator: Any = None  # W3C trace context, read and written (one, made by init())
# The HTTP span of the request being handled: what AsyncLLM.submit hands to the engine as the parent.
_current: ContextVar[Any] = ContextVar("tokenmill_http_span", default=None)


def init(endpoint: str, role: str) -> None:
    """Send this process's spans to `endpoint` (an OTLP/HTTP traces URL, e.g.
    http://collector:4318/v1/traces). `role` says which part of tokenmill the process is (front,
    engine, worker). OTEL_SERVICE_NAME and the SDK's other OTEL_* variables apply."""
    global _tracer, _provider, _propagator
    if _tracer is not None:
        return
    require("tracing", "--otlp-traces-endpoint")
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor
    from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

    import tokenmill

    resource = Resource.create(
        {
            "service.name": os.environ.get("OTEL_SERVICE_NAME", "tokenmill"),
            "service.version": tokenmill.__version__,
            "tokenmill.role": role,
            "process.pid": os.getpid(),
        }
    )
    provider = TracerProvider(resource=resource)
    # Spans leave in batches from the SDK's own thread: a request pays for building its spans, never
    # for the network.
    provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter(endpoint=endpoint)))
    _provider, _tracer = provider, provider.get_tracer("tokenmill")
    _propagator = TraceContextTextMapPropagator()


def enabled() -> bool:
    return _tracer is not None


def flush(timeout_s: float = 2.0) -> None:
    """Send the spans still queued; a collector that does not answer costs at most `timeout_s`."""
    if _provider is not None:
        _provider.force_flush(timeout_millis=int(timeout_s * 1000))


def shutdown() -> None:
    """Send what is left and stop (a process that ends flushes its last spans)."""
    global _tracer, _provider
    if _provider is not None:
        _provider.shutdown()
    _tracer = _provider = None


def wall_ns(mono: float) -> int:
    """A time.monotonic() reading as wall-clock nanoseconds since the epoch."""
    return time.time_ns() - int((time.monotonic() - mono) * 1e9)


def clean_carrier(carrier: object) -> dict[str, str] | None:
    """The trace context of `carrier` (a client's headers, a peer's request), or None: a traceparent of
    W3C's form, and a tracestate only beside one and only if every member is well formed."""
    if not isinstance(carrier, dict):
        return None
    parent, state = carrier.get("traceparent"), carrier.get("tracestate")
    if not isinstance(parent, str) or parent.startswith("ff") or not TRACEPARENT.fullmatch(parent):
        return None
    out = {"traceparent": parent}
    if isinstance(state, str) and len(state) <= MAX_CARRIER_VALUE:
        members = [m.strip() for m in state.split(",") if m.strip()]
        if len(members) <= MAX_TRACESTATE_MEMBERS and all(TRACESTATE_MEMBER.fullmatch(m) for m in members):
            out["tracestate"] = ",".join(members)
    return out


def _parent(carrier: dict[str, str] | None) -> Any:
    return _propagator.extract(carrier) if carrier else None


def carrier_of(span: Any) -> dict[str, str]:
    """The `traceparent` that makes a span in another process a child of `span`."""
    from opentelemetry import trace

    carrier: dict[str, str] = {}
    _propagator.inject(carrier, context=trace.set_span_in_context(span))
    return carrier


def start_span(
    name: str,
    parent: dict[str, str] | None,
    kind: str = "INTERNAL",
    start_ns: int | None = None,
    attributes: dict[str, Any] | None = None,
) -> Any:
    """A span (ended by the caller: `span.end(end_time=...)`) under the span `parent` names."""
    from opentelemetry.trace import SpanKind

    return _tracer.start_span(
        name, context=_parent(parent), kind=SpanKind[kind], start_time=start_ns, attributes=attributes
    )


def child(parent_span: Any, name: str, start_ns: int, end_ns: int, attributes: dict | None = None) -> None:
    """A finished child span of `parent_span` over [start_ns, end_ns] (same process)."""
    from opentelemetry import trace

    span = _tracer.start_span(
        name, context=trace.set_span_in_context(parent_span), start_time=start_ns, attributes=attributes
    )
    span.end(end_time=max(end_ns, start_ns))


# -- the HTTP front's current request ---------------------------------------------------------------


def set_current(span: Any) -> Any:
    """Make `span` the current request's (returns the token for reset_current)."""
    return _current.set(span)


def reset_current(token: Any) -> None:
    _current.reset(token)


def current_span() -> Any:
    return _current.get()


def current_carrier() -> dict[str, str] | None:
    """The trace context an engine request of the current HTTP request carries (None: not traced)."""
    if _tracer is None:
        return None
    span = _current.get()
    return carrier_of(span) if span is not None else None
