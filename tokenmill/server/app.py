"""The FastAPI application: OpenAI routes, health, metadata, tokenize; errors in the OpenAI shape."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import TYPE_CHECKING, Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST
from pydantic import BaseModel, ValidationError
from starlette.exceptions import HTTPException

import tokenmill
from tokenmill import tracing
from tokenmill.engine.fairness import band_of
from tokenmill.frontend.async_llm import AsyncLLM, RequestScope, request_scope
from tokenmill.models.config import ModelConfig
from tokenmill.outputs import RequestOutput
from tokenmill.pooling import Pooling, model_pooling
from tokenmill.server.admission import Admission, Ticket, shed_error
from tokenmill.server.anthropic_protocol import (
    CountTokensRequest,
    MessagesRequest,
    anthropic_error_response,
    is_anthropic_path,
)
from tokenmill.server.anthropic_serving import MessagesServing
from tokenmill.server.config import ServerConfig
from tokenmill.server.console import install_console
from tokenmill.server.embeddings import EmbeddingRequest, PoolingServing, RerankRequest, ScoreRequest
from tokenmill.server.errors import APIError, engine_unavailable, error_response
from tokenmill.server.guards import ApiKeyMiddleware, BodyLimitMiddleware, presented_key
from tokenmill.server.json_body import BodyError, parse_json
from tokenmill.server.lora_registry import LoRARegistry, parse_lora_module
from tokenmill.server.metrics import Metrics
from tokenmill.server.openai_protocol import (
    ChatCompletionRequest,
    ChatMessage,
    ChatTool,
    CompletionRequest,
    RequestFieldError,
    TokenId,
)
from tokenmill.server.openai_serving import OpenAIServing, chat_message_dict
from tokenmill.server.openapi import install as install_openapi
from tokenmill.server.probes import install_probes
from tokenmill.server.response_store import ResponseStore, owner_of
from tokenmill.server.responses_protocol import ResponsesRequest
from tokenmill.server.responses_serving import ResponsesServing
from tokenmill.server.tenants import RESERVED, named_tenants, parse_priority_floors, tenant_of
from tokenmill.server.tool_calls import plan_tools, template_messages
from tokenmill.server.tracing_middleware import TracingMiddleware
from tokenmill.server.tracing_middleware import observe as observe_span

if TYPE_CHECKING:
    from tokenmill.triton.repository import ModelRepository


class TokenizeRequest(BaseModel):
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    tools: list[ChatTool] | None = None  # rendered as chat completions render them
    add_special_tokens: bool = True
    add_generation_prompt: bool = True


class DetokenizeRequest(BaseModel):
    tokens: list[TokenId]


class LoadLoRARequest(BaseModel):
    lora_name: str
    lora_path: str


class UnloadLoRARequest(BaseModel):
    lora_name: str
    lora_int_id: int | None = None  # vLLM's body may carry it; the name is what counts


class ServerState:
    """What the routes share: the frontend, the settings, and admission bookkeeping."""

    def __init__(self, llm: AsyncLLM, config: ServerConfig) -> None:
        self.llm = llm
        self.config = config
        self.admission = Admission(
            config.engine.scheduler.max_num_seqs + config.max_queued_requests,
            config.max_pending_tokens,
            on_shed=lambda ticket: self.metrics.observe_shed(ticket.band),
            # Bands are what the engine serves first only under these: shedding for them too.
            shedding=config.engine.scheduler.policy in ("priority", "fair"),
        )
        # Tenants (server/tenants.py): names the tenant header may not give, and each tenant's floor.
        self.reserved_tenants = RESERVED | named_tenants(config.named_api_key)
        self.priority_floors = parse_priority_floors(config.tenant_priority_floor)
        self.serving = OpenAIServing(
            llm, config.model_name, self.admission, config.tool_call_parser, config.reasoning_parser
        )
        self.serving.engine_config = config.engine
        self.store = ResponseStore(
            config.responses_store_max, int(config.responses_store_mb * 2**20), config.responses_store_ttl_s
        )
        model_config = llm.client.info.get("model_config")
        lora = config.engine.lora
        self.loras = LoRARegistry(
            config.model_name,
            ModelConfig.from_dict(model_config) if model_config else None,
            lora.max_lora_rank,
            lora.enable_lora,
        )
        for text in config.lora_modules:
            module = parse_lora_module(text)
            try:
                self.loras.add(module.name, module.path)
            except APIError as e:
                raise ValueError(f"--lora-modules {module.name}: {e.message}") from None
        self.serving.loras = self.loras
        self.responses = ResponsesServing(self.serving, self.store, self.admission)
        self.messages = MessagesServing(self.serving, self.admission)
        try:
            pooling: Pooling | str = model_pooling(config.engine.model)
        except ValueError as e:  # a pooling this engine does not run: generation is served all the same
            pooling = str(e)
        self.pooling = PoolingServing(self.serving, self.admission, pooling)
        self.metrics = Metrics(llm.client, config.model_name)
        llm.on_finished = self.metrics.observe
        llm.on_aborted = self.metrics.observe_aborted
        self.draining = False
        self.planner: Any = None  # the planner's loop when one runs (server/main.py): the console reads it


def build_app(llm: AsyncLLM, config: ServerConfig, repository: ModelRepository | None = None) -> FastAPI:
    state = ServerState(llm, config)
    app = FastAPI(title="tokenmill", version=tokenmill.__version__)
    app.state.tm = state
    if repository is not None:
        from tokenmill.triton.http import build_router
        from tokenmill.triton.stats import TritonMetrics

        # Triton's metric names go to the same /metrics as the LLM's.
        repository.metrics = TritonMetrics(state.metrics.registry)
        if getattr(repository, "cache", None) is not None:
            repository.metrics.watch_cache(repository.cache)
        # The gRPC front (triton/grpc_front.py) takes the same keys, plain and named.
        repository.api_keys = config.api_keys()
        repository.allow_client_shm = config.allow_client_shm  # (triton/shm.py)
        repository.loras = state.loras  # each adapter a model of the repository, as the LLM is
        repository.admission = state.admission  # the LLM's requests under /v2 count as the OpenAI API's
        app.include_router(build_router(repository, int(config.max_request_body_mb * 2**20)))

    # Errors in the shape of the API the path belongs to: Anthropic's under /v1/messages, OpenAI's
    # elsewhere (KServe's /v2 answers its own).
    @app.exception_handler(APIError)
    async def _api_error(request: Request, e: APIError) -> JSONResponse:
        if is_anthropic_path(request.url.path):
            return anthropic_error_response(e.status, e.message, e.headers)
        return error_response(e.status, e.message, e.param, e.headers)

    @app.exception_handler(RequestValidationError)
    async def _validation(request: Request, e: RequestValidationError) -> JSONResponse:
        if is_anthropic_path(request.url.path):
            return anthropic_error_response(400, _describe(e.errors()))
        return error_response(400, _describe(e.errors()), _param(e.errors()))

    @app.exception_handler(HTTPException)
    async def _http_error(request: Request, e: HTTPException) -> Response:
        # The router's own errors (an unknown path, a method the path does not take), which FastAPI
        # writes as {"detail": ...}: OpenAI clients read only {"error": {...}}, and langchain turns a
        # bare 404 into "model not found". KServe's /v2 is not the OpenAI API's: its router answers
        # its unknown paths and methods itself (triton/http.py); what reaches here under /v2 (a server
        # without --model-repository) answers in the same shape, {"error": "..."}, which tritonclient reads.
        path = request.url.path
        if path == "/v2" or path.startswith("/v2/"):
            message = _http_message(request, e) + ("" if repository else " (no --model-repository is served)")
            return JSONResponse({"error": message}, status_code=e.status_code, headers=e.headers)
        if is_anthropic_path(path):
            return anthropic_error_response(e.status_code, _http_message(request, e), e.headers)
        return error_response(e.status_code, _http_message(request, e), headers=e.headers)

    if config.requires_key:
        app.add_middleware(ApiKeyMiddleware, keys=config.api_keys())
    app.add_middleware(BodyLimitMiddleware, max_bytes=int(config.max_request_body_mb * 2**20))
    if config.engine.otlp_traces_endpoint:
        _install_tracing(app, state, config)

    # -- health and metadata ------------------------------------------------------------------
    @app.get("/health", response_class=Response, responses={200: {"content": {}}, 503: {"content": {}}})
    async def health() -> Response:
        ok = llm.client.healthy
        return Response(status_code=200 if ok else 503)

    @app.get("/v1/health/live")
    async def live() -> JSONResponse:
        # Live means the engine is: a dead or hung engine makes an orchestrator restart the server.
        ok = llm.client.healthy
        msg = "live" if ok else "engine not available"
        return JSONResponse({"object": "health.response", "message": msg}, status_code=200 if ok else 503)

    @app.get("/v1/health/ready")
    async def ready() -> JSONResponse:
        # Ready means a request sent now would be taken: not draining, engine up, capacity left.
        if state.draining:
            msg = "draining"
        elif not llm.client.healthy:
            msg = "engine not available"
        elif state.admission.full:
            msg = "at capacity"
        elif getattr(llm.client, "scaled_to_zero", False):
            # A fleet scaled to zero takes requests: they wait for the worker they start (bounded), so a
            # load balancer must keep sending them; the message says why the first one is slow.
            msg = "ready (no worker running: the next request starts one)"
        else:
            msg = "ready"
        ok = msg.startswith("ready")
        return JSONResponse({"object": "health.response", "message": msg}, status_code=200 if ok else 503)

    @app.get("/metrics", response_class=PlainTextResponse)
    async def metrics() -> Response:
        return Response(state.metrics.render(), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/version")
    async def version() -> dict:
        return {"release": tokenmill.__version__, "api": "openai-v1"}

    @app.get("/v1/metadata")
    async def metadata() -> dict:
        info = llm.client.info
        return {
            "version": tokenmill.__version__,
            "model": config.model_name,
            "modelInfo": [{"shortName": config.model_name, "modelUrl": config.engine.model}],
            "max_model_len": info.get("max_model_len"),
            "kv_cache_blocks": info.get("num_blocks"),
            "block_size": info.get("block_size"),
            # A process id is for the operator (signals, profilers), not for whoever holds a key.
            **({} if config.requires_key else {"engine_pid": llm.client.engine_pid}),
        }

    def model_card() -> dict:
        return {
            "id": config.model_name,
            "object": "model",
            "created": 0,
            "owned_by": "tokenmill",
            "max_model_len": llm.max_model_len,
        }

    @app.get("/v1/models")
    async def models() -> dict:
        return {"object": "list", "data": [model_card(), *state.loras.cards(0, llm.max_model_len)]}

    @app.get("/v1/models/{model_id:path}")
    async def model(model_id: str) -> dict:
        state.serving.check_model(model_id)
        cards = [c for c in state.loras.cards(0, llm.max_model_len) if c["id"] == model_id]
        return cards[0] if cards else model_card()

    # -- LoRA adapters at run time (vLLM's routes) ----------------------------------------------------
    def _runtime_updating() -> None:
        if not config.enable_lora_runtime_updating:
            raise APIError(
                404, "adapters are not loaded at run time here: start with --enable-lora-runtime-updating"
            )

    @app.post("/v1/load_lora_adapter", response_class=PlainTextResponse)
    async def load_lora_adapter(request: Request) -> PlainTextResponse:
        _runtime_updating()
        body = await _json_model(request, LoadLoRARequest)
        # The check reads the adapter's files: off the event loop, which serves the streams meanwhile.
        await asyncio.to_thread(state.loras.add, body.lora_name, body.lora_path)
        return PlainTextResponse(f"Success: LoRA adapter '{body.lora_name}' added successfully.")

    @app.post("/v1/unload_lora_adapter", response_class=PlainTextResponse)
    async def unload_lora_adapter(request: Request) -> PlainTextResponse:
        _runtime_updating()
        body = await _json_model(request, UnloadLoRARequest)
        state.loras.remove(body.lora_name)
        # Requests already running on it finish on it; the engine reuses its slot once they have.
        return PlainTextResponse(f"Success: LoRA adapter '{body.lora_name}' removed successfully.")

    # -- generation ---------------------------------------------------------------------------
    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        body = await _json_model(request, CompletionRequest)
        _session_header(request, body)
        return await _generate(request, state, lambda t: state.serving.completions(body, t), body)

    @app.post("/v1/chat/completions")
    async def chat(request: Request) -> Response:
        body = await _json_model(request, ChatCompletionRequest)
        _session_header(request, body)
        return await _generate(request, state, lambda t: state.serving.chat(body, t), body)

    # -- the Responses API -------------------------------------------------------------------------
    def owner(request: Request) -> str:
        return owner_of(presented_key(dict(request.headers.raw)))

    @app.post("/v1/responses")
    async def responses(request: Request) -> Response:
        body = await _json_model(request, ResponsesRequest)
        if body.background:
            return await _background(request, state, body, owner(request))
        return await _generate(
            request, state, lambda t: state.responses.create(body, t, owner(request)), body
        )

    @app.get("/v1/responses/{response_id}")
    async def get_response(request: Request, response_id: str) -> dict:
        return _stored(state, response_id, owner(request)).response

    @app.delete("/v1/responses/{response_id}")
    async def delete_response(request: Request, response_id: str) -> dict:
        if not state.store.delete(response_id, owner(request)):
            raise APIError(404, f"response {response_id!r} not found", "response_id")
        return {"id": response_id, "object": "response.deleted", "deleted": True}

    @app.post("/v1/responses/{response_id}/cancel")
    async def cancel_response(request: Request, response_id: str) -> dict:
        return await state.responses.cancel(response_id, owner(request))

    @app.get("/v1/responses/{response_id}/input_items")
    async def response_input_items(
        request: Request, response_id: str, order: str = "desc", limit: int = 20, after: str | None = None
    ) -> dict:
        items = list(_stored(state, response_id, owner(request)).input_items)
        return _page(items, order, limit, after)

    # -- embeddings, and scores from them: a body, then generation under admission -------------------
    def generation_route(path: str, summary: str, model: type[BaseModel], run: Callable) -> None:
        async def handler(request: Request) -> Response:
            body = await _json_model(request, model)
            return await _generate(request, state, lambda t: run(body, t), body)

        app.post(path, summary=summary)(handler)

    generation_route("/v1/embeddings", "Embeddings", EmbeddingRequest, state.pooling.embeddings)
    generation_route("/v1/score", "Score", ScoreRequest, state.pooling.score)
    generation_route("/v1/rerank", "Rerank", RerankRequest, state.pooling.rerank)
    generation_route("/v1/messages", "Messages", MessagesRequest, state.messages.create)

    # -- the Anthropic Messages API ----------------------------------------------------------------
    @app.post("/v1/messages/count_tokens")
    async def count_tokens(request: Request) -> dict:
        body = await _json_model(request, CountTokensRequest)
        ticket = state.admission.admit()  # the template and tokenizer are the work here
        try:
            return {"input_tokens": await state.messages.count_tokens(body)}
        finally:
            state.admission.release(ticket)

    @app.post("/tokenize")
    async def tokenize(request: Request) -> dict:
        body = await _json_model(request, TokenizeRequest)
        # Under admission like a generation: tokenizing is the work here, and it has a cost.
        ticket = state.admission.admit()
        try:
            return await _tokenize(state, body)
        finally:
            state.admission.release(ticket)

    @app.post("/detokenize")
    async def detokenize(request: Request) -> dict:
        body = await _json_model(request, DetokenizeRequest)
        vocab = llm.client.info.get("vocab_size", 1 << 62)
        if any(not 0 <= t < vocab for t in body.tokens):
            raise APIError(400, f"token ids must be in [0, {vocab})", "tokens")
        return {"prompt": llm.tokenizer.decode(body.tokens, skip_special_tokens=False)}

    install_probes(app, state, llm, config, _json_model)
    install_console(app, state)

    install_openapi(
        app,
        {
            "/v1/completions": CompletionRequest,
            "/v1/chat/completions": ChatCompletionRequest,
            "/v1/completions/render": CompletionRequest,
            "/v1/chat/completions/render": ChatCompletionRequest,
            "/v1/responses": ResponsesRequest,
            "/v1/messages": MessagesRequest,
            "/v1/messages/count_tokens": CountTokensRequest,
            "/v1/embeddings": EmbeddingRequest,
            "/v1/score": ScoreRequest,
            "/v1/rerank": RerankRequest,
            "/tokenize": TokenizeRequest,
            "/detokenize": DetokenizeRequest,
            "/v1/load_lora_adapter": LoadLoRARequest,
            "/v1/unload_lora_adapter": UnloadLoRARequest,
        },
        streaming={"/v1/completions", "/v1/chat/completions", "/v1/responses", "/v1/messages"},
    )
    return app


def _install_tracing(app: FastAPI, state: ServerState, config: ServerConfig) -> None:
    """Spans of the HTTP front (outermost middleware: refusals are traced too), with what the engine
    reports of each finished request."""
    tracing.init(config.engine.otlp_traces_endpoint, "front")  # type: ignore[arg-type]
    app.add_middleware(TracingMiddleware, model=config.model_name)
    metrics_observe = state.metrics.observe

    def observe(ro: RequestOutput) -> None:
        metrics_observe(ro)
        observe_span(ro)

    state.llm.on_finished = observe


async def _json_model(request: Request, model: type[BaseModel]) -> Any:
    raw = await request.body()
    try:
        data = parse_json(raw)
    except BodyError as e:
        raise APIError(400, str(e)) from e
    if not isinstance(data, dict):
        raise APIError(400, "the request body must be a JSON object")
    try:
        return model.model_validate(data)
    except ValidationError as e:
        raise APIError(400, _describe(e.errors()), _param(e.errors())) from e


SESSION_HEADER = "x-session-id"


def _session_header(request: Request, body: CompletionRequest | ChatCompletionRequest) -> None:
    """A session id header keys the router's session policy like the body's `user` field (which wins)."""
    if body.user is None and (sid := request.headers.get(SESSION_HEADER)):
        body.user = sid[:256]


async def _tokenize(state: ServerState, body: TokenizeRequest) -> dict:
    serving, tok = state.serving, state.llm.tokenizer
    if body.messages is not None:
        # The same prompt a chat completion would build: tools and tool turns rendered alike.
        tools = [t.model_dump(exclude_none=True) for t in body.tools or []]
        try:
            plan = plan_tools(tools, None)
        except RequestFieldError as e:
            raise APIError(400, str(e), e.param) from e
        messages, prompt_tools = template_messages(
            [chat_message_dict(m) for m in body.messages], plan, tok.supports_tools
        )
        extra = {"tools": prompt_tools} if prompt_tools else {}
        ids = await serving.encode_chat(messages, body.add_generation_prompt, extra)
    elif body.prompt is not None:
        ids = (await serving.encode([body.prompt], "prompt", body.add_special_tokens))[0]
    else:
        raise APIError(400, "send `prompt` (text) or `messages` (a chat)")
    return {"tokens": ids, "count": len(ids), "max_model_len": state.llm.max_model_len}


def _admit(state: ServerState, band: int = 0, scope: RequestScope | None = None) -> Ticket:
    """A ticket for a generation, or 503 (draining, no engine) or 429 (full, and no request of a higher
    band to shed)."""
    if state.draining:
        state.metrics.observe_failure("rejected_draining")
        raise APIError(503, "the server is shutting down", headers={"Retry-After": "5"})
    if not state.llm.client.healthy:
        state.metrics.observe_failure("engine_unavailable")
        raise APIError(503, engine_unavailable(state.llm.client.dead_reason or "not ready"))
    try:
        return state.admission.admit(band, scope)
    except APIError:
        state.metrics.observe_failure("rejected_overload")
        raise


def _scope(request: Request, state: ServerState, body: Any) -> tuple[RequestScope, int]:
    """The request's scope: its tenant and priority floor (server/tenants.py), and what it submits (so
    it can be shed); and its band: the body's priority raised to the floor (the body says so too, and
    what the scope submits is raised alike)."""
    tenant = tenant_of(request.scope, state.config.tenant_header, state.reserved_tenants)
    scope = RequestScope(tenant, state.priority_floors.get(tenant or "default", 0))
    band = scope.clamp(getattr(body, "priority", 0))
    if state.config.engine.scheduler.policy == "fair":
        band = band_of(band)  # the fair queue's bands (engine/fairness.py): shedding sees the same
    if hasattr(body, "priority"):
        body.priority = band
    return scope, band


async def _background(request: Request, state: ServerState, body: ResponsesRequest, owner: str) -> Response:
    """A background response: admitted like any generation, answered at once (queued); its task
    gives the ticket back when it ends."""
    scope, band = _scope(request, state, body)
    ticket = _admit(state, band, scope)
    try:
        with request_scope(scope):  # the task copies it: its sequences join the scope
            run = await state.responses.prepare(body, owner)
            state.admission.add_work(ticket, 1, len(run.prep.ids))
            answer = state.responses.start_background(run, ticket)
            scope.responded = True  # the client has its id: the response is not shed from now on
            return JSONResponse(answer)
    except BaseException:
        state.admission.release(ticket)
        raise


def _stored(state: ServerState, response_id: str, owner: str):  # noqa: ANN202
    entry = state.store.get(response_id, owner)
    if entry is None:
        raise APIError(404, f"response {response_id!r} not found", "response_id")
    return entry


def _page(items: list[dict], order: str, limit: int, after: str | None) -> dict:
    """A list page in OpenAI's shape (input_items): `order` asc or desc, up to `limit` after an id."""
    if order not in ("asc", "desc"):
        raise APIError(400, "order must be asc or desc", "order")
    if not 1 <= limit <= 100:
        raise APIError(400, "limit must be between 1 and 100", "limit")
    if order == "desc":
        items.reverse()
    if after is not None:
        ids = [i.get("id") for i in items]
        if after not in ids:
            raise APIError(400, f"no item {after!r} in this list", "after")
        items = items[ids.index(after) + 1 :]
    page = items[:limit]
    return {
        "object": "list",
        "data": page,
        "first_id": page[0].get("id") if page else None,
        "last_id": page[-1].get("id") if page else None,
        "has_more": len(items) > limit,
    }


async def _generate(
    request: Request, state: ServerState, make: Callable[[Ticket], Awaitable[Any]], body: Any
) -> Response:
    """Admit a generation (in the band of the body's priority, raised to the tenant's floor), run it in
    its scope, answer it whole or as a stream."""
    scope, band = _scope(request, state, body)
    ticket = _admit(state, band, scope)
    try:
        with request_scope(scope):  # the task running `make` copies it
            result = await _cancel_on_disconnect(request, make(ticket))
            if not isinstance(result, dict):
                if ticket.shed:  # shed before its stream began: a 503 the client can retry on
                    await result.aclose()
                    raise shed_error(band)
                scope.responded = True  # its 200 goes out now: from here on it is never shed
    except BaseException as e:
        state.admission.release(ticket)
        if ticket.shed:
            pass  # counted where it was shed
        elif isinstance(e, APIError) and e.status == 429:
            state.metrics.observe_failure("rejected_overload")
        elif isinstance(e, APIError) and e.status >= 500:  # the engine failed or died under it
            state.metrics.observe_failure("engine_unavailable" if e.status == 503 else "engine_error")
        raise
    if isinstance(result, dict):
        state.admission.release(ticket)
        return JSONResponse(result)

    async def stream() -> AsyncIterator[str]:
        try:
            with request_scope(scope):  # the sequences a stream submits join the request's scope
                async for chunk in result:  # cancelled by Starlette when the client goes away
                    yield chunk
        finally:
            await result.aclose()
            state.admission.release(ticket)

    return StreamingResponse(stream(), media_type="text/event-stream")


async def _cancel_on_disconnect(request: Request, coro: Awaitable[Any]) -> Any:
    """Run a non-streaming generation, cancelling it (and so aborting it) if the client disconnects."""
    task = asyncio.ensure_future(coro)

    async def watch() -> None:
        while not task.done():
            if await request.is_disconnected():
                task.cancel()
                return
            await asyncio.sleep(0.2)

    watcher = asyncio.create_task(watch())
    try:
        return await task
    finally:
        watcher.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await watcher


def _http_message(request: Request, e: HTTPException) -> str:
    where = f"{request.method} {request.url.path}"
    if e.status_code == 404:
        return f"Invalid URL ({where}): no such route on this server"
    if e.status_code == 405:
        allowed = (e.headers or {}).get("Allow", "")
        return f"Invalid method for URL ({where})" + (f": use {allowed}" if allowed else "")
    return f"{e.detail} ({where})"


def _describe(errors: list[dict]) -> str:
    parts = []
    for err in errors[:3]:
        loc = ".".join(str(x) for x in err.get("loc", ()) if x != "body")
        parts.append(f"{loc}: {err.get('msg')}" if loc else str(err.get("msg")))
    return "invalid request: " + "; ".join(parts)


def _param(errors: list[dict]) -> str | None:
    if not errors:
        return None
    loc = [str(x) for x in errors[0].get("loc", ()) if x != "body"]
    return loc[0] if loc else None
