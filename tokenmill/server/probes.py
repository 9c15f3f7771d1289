"""The endpoints routers and gateways of other projects probe on a model server (SGLang's and vLLM's
names), so that sglang-router, vllm-router or a gateway scheduler can put a tokenmill server in a pool:

- GET /health_generate: one token through the engine (SGLang's deep health check);
- GET /get_model_info, /model_info and GET /get_server_info, /server_info: what is served and how
  (sglang-router names a worker's model from `served_model_name` / `model_path`);
- GET /version (vLLM's);
- GET /get_loads, /v1/loads: the engine's load in SGLang's shape;
- POST /flush_cache: the engine forgets its free cached blocks (behind the API key);
- POST /v1/completions/render and /v1/chat/completions/render: the token ids a request would run on
  (vLLM's; vllm-router's kv_aware policy asks for them to match a prompt against the KV events).
"""

from __future__ import annotations

import asyncio
import time
import uuid
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response

import tokenmill
from tokenmill.engine.client import EngineDeadError
from tokenmill.frontend.async_llm import AsyncLLM
from tokenmill.sampling_params import SamplingParams
from tokenmill.server.config import ServerConfig
from tokenmill.server.errors import APIError, engine_unavailable
from tokenmill.server.openai_protocol import ChatCompletionRequest, CompletionRequest
from tokenmill.weights import catalog

HEALTH_GENERATE_TIMEOUT_S = 20.0
HEALTH_GENERATE_FRESH_S = 1.0  # callers within this long of a probe share its answer
STARTED = time.time()


def install_probes(app: FastAPI, state: Any, llm: AsyncLLM, config: ServerConfig, read_json: Any) -> None:
    """`state` is the server's ServerState; `read_json(request, model)` parses a body as the routes do."""

    # One probe generation at a time, its answer shared for a second: probes cost the engine at most one
    # token a second however many callers there are (it runs outside admission, as a health check must).
    probe_lock = asyncio.Lock()
    last: list[float] = [-HEALTH_GENERATE_FRESH_S, 503]  # when, and what, the last probe answered

    @app.get(
        "/health_generate", response_class=Response, responses={200: {"content": {}}, 503: {"content": {}}}
    )
    async def health_generate() -> Response:
        if state.draining or not llm.client.healthy:
            return Response(status_code=503)
        if getattr(llm.client, "scaled_to_zero", False):
            # No engine to probe, by design: a probe's token would start a worker (and keep the fleet
            # from ever scaling to zero), and a request now would be served once one has started.
            return Response(status_code=200)
        async with probe_lock:
            if time.monotonic() - last[0] >= HEALTH_GENERATE_FRESH_S:
                status = await _one_token(llm)
                last[:] = [time.monotonic(), status]
            return Response(status_code=int(last[1]))

    # Where the weights and tokenizer are on this host: a router that loads the tokenizer itself
    # (sglang-router) reads it from there rather than asking a model hub for the model's name.
    where = str(catalog.resolve(config.engine.model))

    def model_info() -> dict[str, Any]:
        mc = llm.client.info.get("model_config") or {}
        return {
            "model_path": where,
            "served_model_name": config.model_name,
            "tokenizer_path": where,
            "is_generation": True,
            "preferred_sampling_params": None,
            "weight_version": "default",
            "model_type": mc.get("architecture"),  # the family: Hugging Face's model_type ("llama", ...)
            "max_model_len": llm.max_model_len,
        }

    def server_info() -> dict[str, Any]:
        info, st = llm.client.info, llm.client.stats
        block, blocks = info.get("block_size"), info.get("num_blocks")
        return {
            **model_info(),
            "version": tokenmill.__version__,
            "context_length": llm.max_model_len,
            "page_size": block,
            "max_total_num_tokens": block * blocks if block and blocks else None,
            "tp_size": config.engine.parallel.tensor_parallel_size,
            "pp_size": config.engine.parallel.pipeline_parallel_size,
            "dp_size": 1,
            "disaggregation_mode": info.get("kv_role") or "null",
            "kv_events": _kv_events(config),
            "startup_time": STARTED,
            "num_running_reqs": st.num_running if st else 0,
            "num_waiting_reqs": st.num_waiting if st else 0,
        }

    for path in ("/get_model_info", "/model_info"):
        app.add_api_route(path, model_info, methods=["GET"], include_in_schema=path == "/model_info")
    for path in ("/get_server_info", "/server_info"):
        app.add_api_route(path, server_info, methods=["GET"], include_in_schema=path == "/server_info")

    @app.get("/version")
    async def version() -> dict:
        return {"version": tokenmill.__version__}

    async def loads() -> dict:
        st = llm.client.stats
        info = llm.client.info
        total = (info.get("block_size") or 0) * (info.get("num_blocks") or 0)
        usage = st.kv_cache_usage if st else 0.0
        return {
            "timestamp": time.time(),
            "version": tokenmill.__version__,
            "loads": [
                {
                    "dp_rank": 0,
                    "num_running_reqs": st.num_running if st else 0,
                    "num_waiting_reqs": st.num_waiting if st else 0,
                    "num_used_tokens": round(usage * total),
                    "max_total_num_tokens": total,
                    "token_usage": usage,
                }
            ],
        }

    app.add_api_route("/get_loads", loads, methods=["GET"], include_in_schema=False)
    app.add_api_route("/v1/loads", loads, methods=["GET"])

    @app.post("/flush_cache", response_class=PlainTextResponse)
    async def flush_cache() -> PlainTextResponse:
        try:
            llm.client.reset_prefix_cache()  # every engine client can (a fleet's: each live worker)
        except EngineDeadError as e:
            raise APIError(503, engine_unavailable(str(e))) from None
        return PlainTextResponse("Cache flushed.\n")

    @app.post("/v1/completions/render")
    async def render_completion(request: Request) -> JSONResponse:
        body = await read_json(request, CompletionRequest)
        prompts = await state.serving.completion_prompts(body)
        rendered = [{"token_ids": ids, "features": None} for _, ids in prompts]
        return JSONResponse(rendered[0] if len(rendered) == 1 else rendered)

    @app.post("/v1/chat/completions/render")
    async def render_chat(request: Request) -> JSONResponse:
        body = await read_json(request, ChatCompletionRequest)
        prep = await state.serving.prepare_chat(body)
        return JSONResponse({"token_ids": prep.ids, "features": None})


async def _one_token(llm: AsyncLLM) -> int:
    """200 if one token went through the engine in time, else 503."""
    bos = llm.tokenizer.bos_token_id
    ids = [bos if bos is not None else 0]
    params = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)

    async def run() -> None:
        async for _ in llm.generate(f"health-{uuid.uuid4().hex}", ids, params):
            pass

    try:
        await asyncio.wait_for(run(), HEALTH_GENERATE_TIMEOUT_S)
    except Exception:  # noqa: BLE001 - any failure, a timeout included, is an unhealthy engine
        return 503
    return 200


def _kv_events(config: ServerConfig) -> dict[str, Any] | None:
    ev = config.engine.kv_events
    if not ev.enable_kv_events:
        return None
    return {"endpoint": ev.kv_events_endpoint, "replay_endpoint": ev.kv_events_replay_endpoint,
            "topic": ev.kv_events_topic}  # fmt: skip
