"""The HTTP front's spans: one SERVER span per generation request, from its arrival until the last byte
of its answer (a stream included), a child of the client's `traceparent` when it sends one.

A pure ASGI middleware, outermost, so a request refused by the key or body checks is traced too, and
the span is the current one (tokenmill.tracing's context variable) while the routes run: AsyncLLM
hands it to the engine as the parent of the engine's span. What the engine reports when a request ends
(tokens, time to first token, queue time) is added to it by `observe`.
"""

from __future__ import annotations

from typing import Any

from tokenmill import tracing
from tokenmill.outputs import RequestOutput

# The routes that generate (or pool) with the model; the rest (health and its probe of the model,
# metrics, the console's reads) would only bury the requests in spans.
TRACED = (
    "/v1/completions",
    "/v1/chat/completions",
    "/v1/responses",
    "/v1/messages",
    "/v1/embeddings",
    "/v1/score",
    "/v1/rerank",
)


class TracingMiddleware:
    def __init__(self, app: Any, model: str) -> None:
        self.app, self.model = app, model

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        path = scope.get("path", "") if scope["type"] == "http" else ""
        if path not in TRACED:
            await self.app(scope, receive, send)
            return
        method = scope.get("method", "")
        found: dict[str, list[str]] = {"traceparent": [], "tracestate": []}
        for k, v in scope.get("headers", ()):
            if k in (b"traceparent", b"tracestate"):
                found[k.decode()].append(v.decode("latin-1"))
        # W3C: two traceparent headers make none; several tracestate headers are one list.
        carrier = {"tracestate": ",".join(found["tracestate"])}
        if len(found["traceparent"]) == 1:
            carrier["traceparent"] = found["traceparent"][0]
        span = tracing.start_span(
            f"{method} {path}",
            tracing.clean_carrier(carrier),
            "SERVER",
            attributes={"http.request.method": method, "url.path": path, "gen_ai.request.model": self.model},
        )
        token = tracing.set_current(span)
        status = [500]

        async def send_traced(message: dict) -> None:
            if message["type"] == "http.response.start":
                status[0] = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, send_traced)
        finally:
            tracing.reset_current(token)
            span.set_attribute("http.response.status_code", status[0])
            if status[0] >= 500:
                from opentelemetry.trace import Status, StatusCode

                span.set_status(Status(StatusCode.ERROR))
            span.end()


def observe(ro: RequestOutput) -> None:
    """Add a finished request's figures to the current HTTP span (summed over its prompts and
    sequences; the latencies are the first sequence's, as vLLM's span attributes)."""
    span = tracing.current_span()
    if span is None or not span.is_recording():
        return
    attrs = getattr(span, "attributes", None) or {}
    added = {
        "gen_ai.usage.input_tokens": attrs.get("gen_ai.usage.input_tokens", 0) + len(ro.prompt_token_ids),
        "gen_ai.usage.output_tokens": attrs.get("gen_ai.usage.output_tokens", 0)
        + sum(len(o.token_ids) for o in ro.outputs),
    }
    m = ro.outputs[0].metrics if ro.outputs else None
    if m is not None and "gen_ai.latency.e2e" not in attrs:
        if m.first_scheduled_time is not None:
            added["gen_ai.latency.time_in_queue"] = m.first_scheduled_time - m.arrival_time
        if m.first_token_time is not None:
            added["gen_ai.latency.time_to_first_token"] = m.first_token_time - m.arrival_time
        if m.finished_time is not None:
            added["gen_ai.latency.e2e"] = m.finished_time - m.arrival_time
    span.set_attributes(added)
