"""The server's OpenAPI document, with the request bodies and error responses FastAPI cannot see.

The generation routes read their bodies themselves (json_body.py: depth and Unicode limits before
pydantic), so FastAPI would describe no request body and only a 200. This adds each route's body
schema (from the same pydantic models that validate it) and the error responses every route can give,
so `/docs`, client generators and schema-driven fuzzers get the real contract.
"""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi
from pydantic import BaseModel

from tokenmill.server.openai_protocol import ErrorResponse
from tokenmill.triton.dtypes import NUMPY

# Errors any route may answer (auth, body limits, capacity, engine failure, unavailability).
_COMMON_ERRORS = {
    "401": "invalid or missing API key",
    "413": "request body too large",
    "503": "engine not available, or the server is draining",
}
_BODY_ERRORS = {
    "400": "invalid request (the message names the field)",
    "403": "kv_transfer_params names a prefill server this one does not read from",
    "404": "no such model",
    "429": "at capacity; retry after the Retry-After header's seconds",
    "500": "the engine failed on this request (the message names the request id)",
}
# KServe v2 (/v2, server/../triton/http.py): errors are {"error": message}; readiness is a status code.
_V2_ERRORS = {
    "400": "invalid request, or a model or version not ready (the message says which)",
    "404": "no such model or version",
    "503": "the model or its engine is not available",
}
_V2_ERROR = {
    "type": "object",
    "properties": {"error": {"type": "string"}},
    "required": ["error"],
}
_V2_STATUS_ONLY = {"/v2/health/live", "/v2/health/ready"}  # no body: 200 or 400 says it
# KServe v2's request bodies (the inference request, the repository extension's), as the protocol
# defines them; triton/http.py refuses with a 400 whatever these call invalid.
_V2_PARAMETERS = {
    "type": "object",
    "additionalProperties": {"anyOf": [{"type": "string"}, {"type": "number"}, {"type": "boolean"}]},
}
_V2_INFER_REQUEST = {
    "type": "object",
    "required": ["inputs"],
    "properties": {
        "id": {"type": "string"},
        "parameters": _V2_PARAMETERS,
        "inputs": {
            "type": "array",
            "items": {
                "type": "object",
                "required": ["name", "shape", "datatype"],
                "properties": {
                    "name": {"type": "string"},
                    "shape": {"type": "array", "items": {"type": "integer", "minimum": 0}},
                    "datatype": {"type": "string", "enum": list(NUMPY)},
                    "parameters": _V2_PARAMETERS,
                    # Row-major tensor elements, flat or nested; absent when the binary_data_size
                    # parameter says the tensor follows the JSON header in binary.
                    "data": {"type": "array"},
                },
            },
        },
        "outputs": {
            "type": "array",
            "items": {
                "type": "object",
                "required": ["name"],
                "properties": {"name": {"type": "string"}, "parameters": _V2_PARAMETERS},
            },
        },
    },
}
_V2_BODIES: dict[str, tuple[bool, dict[str, Any]]] = {  # path suffix -> (required, schema)
    "/infer": (True, _V2_INFER_REQUEST),
    "/repository/index": (False, {"type": "object", "properties": {"ready": {"type": "boolean"}}}),
    "/load": (False, {"type": "object", "properties": {"parameters": {"type": "object"}}}),
    "/unload": (False, {"type": "object", "properties": {"parameters": {"type": "object"}}}),
    # System shared memory (triton/shm.py): a region of a POSIX shared-memory object.
    "/register": (
        True,
        {
            "type": "object",
            "required": ["key", "byte_size"],
            "properties": {
                "key": {"type": "string"},
                "offset": {"type": "integer", "minimum": 0},
                "byte_size": {"type": "integer", "minimum": 0},
            },
        },
    ),
    # The generate extension (triton/generate.py): input names and parameters as keys.
    "/generate": (True, {"type": "object"}),
    "/generate_stream": (True, {"type": "object"}),
}
# Anthropic's error shape, for /v1/messages (anthropic_protocol.py).
_ANTHROPIC_ERROR = {
    "type": "object",
    "required": ["type", "error"],
    "properties": {
        "type": {"const": "error"},
        "error": {
            "type": "object",
            "required": ["type", "message"],
            "properties": {"type": {"type": "string"}, "message": {"type": "string"}},
        },
    },
}
_REF = "#/components/schemas/{model}"
_SSE_EVENT = {"type": "object", "properties": {"data": {"type": "string"}}, "required": ["data"]}


def install(app: FastAPI, bodies: dict[str, type[BaseModel]], streaming: set[str]) -> None:
    """`bodies`: POST path -> the model of its JSON body; `streaming`: paths that may answer with SSE."""

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is not None:
            return app.openapi_schema
        doc = get_openapi(title=app.title, version=app.version, routes=app.routes)
        schemas = doc.setdefault("components", {}).setdefault("schemas", {})
        _add_model(schemas, ErrorResponse)
        openai_error = {"application/json": {"schema": {"$ref": _REF.format(model="ErrorResponse")}}}
        for path, ops in doc.get("paths", {}).items():
            for method, op in ops.items():
                responses = op.setdefault("responses", {})
                if path.startswith("/v2"):
                    _document_v2(path, op, responses)
                    continue
                anthropic = path == "/v1/messages" or path.startswith("/v1/messages/")
                error = {"application/json": {"schema": _ANTHROPIC_ERROR}} if anthropic else openai_error
                if "422" in responses:  # parameter errors are answered 400 (app.py), as body errors
                    del responses["422"]
                    responses["400"] = {"description": "invalid parameter", "content": error}
                if "{" in path:  # an id in the path that names nothing
                    responses.setdefault("404", {"description": "not found", "content": error})
                for code, text in _COMMON_ERRORS.items():
                    responses.setdefault(code, {"description": text, "content": error})
                if method != "post" or path not in bodies:
                    continue
                model = bodies[path]
                _add_model(schemas, model)
                op["requestBody"] = {
                    "required": True,
                    "content": {"application/json": {"schema": {"$ref": _REF.format(model=model.__name__)}}},
                }
                for code, text in _BODY_ERRORS.items():
                    responses.setdefault(code, {"description": text, "content": error})
                if path in streaming:
                    ok = responses.setdefault("200", {"description": "Successful Response"})
                    content = ok.setdefault("content", {})
                    content.setdefault("application/json", {"schema": {}})
                    # Server-sent events: each `data:` line a JSON chunk, the last `[DONE]`.
                    content["text/event-stream"] = {"schema": _SSE_EVENT}
        app.openapi_schema = doc
        return doc

    app.openapi = openapi  # type: ignore[method-assign]


def _add_model(schemas: dict[str, Any], model: type[BaseModel]) -> None:
    js = model.model_json_schema(ref_template=_REF)
    for name, sub in js.pop("$defs", {}).items():
        schemas.setdefault(name, sub)
    schemas[model.__name__] = js


def _document_v2(path: str, op: dict[str, Any], responses: dict[str, Any]) -> None:
    """A /v2 operation's body and answers in KServe v2's shape: readiness by status code alone, errors
    as {"error": message}."""
    for suffix, (required, schema) in _V2_BODIES.items():
        if path.endswith(suffix):
            op["requestBody"] = {"required": required, "content": {"application/json": {"schema": schema}}}
    v2_error = {"application/json": {"schema": _V2_ERROR}}
    if path in _V2_STATUS_ONLY or path.endswith("/ready"):
        responses["200"] = {"description": "ready (or live); no body"}
        responses["400"] = {"description": "not ready; no body"}
        if path not in _V2_STATUS_ONLY:
            responses["404"] = {"description": "no such model or version", "content": v2_error}
        return
    if "/load" in path or "/unload" in path or path.endswith("register"):  # (and unregister)
        responses["200"] = {"description": "done; no body"}
    if path.endswith("/generate_stream"):  # server-sent events, each `data:` line a JSON response
        ok = responses.setdefault("200", {"description": "Successful Response"})
        ok.setdefault("content", {})["text/event-stream"] = {"schema": _SSE_EVENT}
    for code, text in {**_V2_ERRORS, "401": _COMMON_ERRORS["401"], "413": _COMMON_ERRORS["413"]}.items():
        responses.setdefault(code, {"description": text, "content": v2_error})
