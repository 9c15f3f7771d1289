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

# Errors any route may answer (auth, body limits, capacity, engine failure, unavailability).
_COMMON_ERRORS = {
    "401": "invalid or missing API key",
    "413": "request body too large",
    "503": "engine not available, or the server is draining",
}
_BODY_ERRORS = {
    "400": "invalid request (the message names the field)",
    "404": "no such model",
    "429": "at capacity; retry after the Retry-After header's seconds",
    "500": "the engine failed on this request (the message names the request id)",
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
        error = {"application/json": {"schema": {"$ref": _REF.format(model="ErrorResponse")}}}
        for path, ops in doc.get("paths", {}).items():
            for method, op in ops.items():
                responses = op.setdefault("responses", {})
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
