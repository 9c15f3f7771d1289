"""The engine's span of one request: from its arrival here to its end, with what happened between.

Built once, when the request ends (Scheduler.on_finished), from the timestamps the engine keeps
anyway: tracing costs the engine loop nothing per step. Only requests that carry a trace context
(EngineRequest.trace_context) get one.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from tokenmill import tracing
from tokenmill.engine.throttled_log import ThrottledWarnings

if TYPE_CHECKING:
    from tokenmill.engine.request import Request

_warn = ThrottledWarnings(logging.getLogger(__name__), every_s=60.0)


def emit(req: Request, role: str | None, block_size: int) -> None:
    """Never raises: it runs inside the engine loop, where an exception would end the engine."""
    if req.trace_context is None or not tracing.enabled():
        return
    try:
        _emit(req, role, block_size)
    except Exception as e:  # the SDK's, on a value it cannot take: the span is lost, not the engine
        _warn.warning("could not build a request's trace span: %r", e)


def _emit(req: Request, role: str | None, block_size: int) -> None:
    end = req.finished_time or req.received_time
    p = req.params
    attributes = {
        "gen_ai.request.id": req.request_id,
        "gen_ai.request.max_tokens": req.max_tokens,
        "gen_ai.request.temperature": p.temperature,
        "gen_ai.request.top_p": p.top_p,
        "gen_ai.usage.input_tokens": req.num_prompt_tokens,
        "gen_ai.usage.output_tokens": len(req.output_token_ids),
        "gen_ai.response.finish_reasons": [str(req.finish_reason or "abort")],
        "tokenmill.cached_tokens": max(req.num_cached_tokens, 0),
        "tokenmill.kv.loaded_blocks": req.kv_external_blocks,
        "tokenmill.kv.loaded_tokens": req.kv_external_blocks * block_size,
        "tokenmill.preemptions": req.num_preemptions,
    }
    if role:
        attributes["tokenmill.kv_role"] = role
    if req.lora is not None:
        attributes["tokenmill.lora"] = req.lora.lora_name
    first, token = req.first_scheduled_time, req.first_token_time
    if first is not None:
        attributes["tokenmill.queue_time_s"] = first - req.received_time
    if first is not None and token is not None:
        attributes["tokenmill.prefill_time_s"] = token - first
        attributes["tokenmill.decode_time_s"] = end - token
    # One offset between the clocks for the span and its children: they nest exactly.
    offset = tracing.wall_ns(0.0)

    def ns(mono: float) -> int:
        return offset + int(mono * 1e9)

    span = tracing.start_span("llm_request", req.trace_context, "SERVER", ns(req.received_time), attributes)
    # The phases, each a child over its own interval; one the request never reached is left out.
    queue_end = first if first is not None else end
    if req.kv_load_times is not None:
        start, done = req.kv_load_times
        tracing.child(
            span,
            "kv_load",
            ns(start),
            ns(done or end),
            {"tokenmill.kv.loaded_blocks": req.kv_external_blocks},
        )
    tracing.child(span, "queue", ns(req.received_time), ns(queue_end))
    if first is not None:
        tracing.child(span, "prefill", ns(first), ns(token if token is not None else end))
    if token is not None:
        tracing.child(
            span, "decode", ns(token), ns(end), {"gen_ai.usage.output_tokens": len(req.output_token_ids)}
        )
    span.end(end_time=ns(end))
