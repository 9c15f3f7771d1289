"""Triton's generate extension: `POST /v2/models/{name}[/versions/{v}]/generate` and `/generate_stream`.

A JSON object instead of tensors: each top-level key that names one of the model's inputs becomes that
input (a scalar a one-element tensor, a list a tensor of its shape; a batched model's batch of one is
added), every other key, and the `parameters` object, become request parameters. The answer names
each output: a one-element output as its value (`"text_output": "..."`), others as (nested) lists.
`generate` answers once; `generate_stream` sends each response of a decoupled model as a server-sent
event (`data: {...}`), and a failure after the first one as `data: {"error": "..."}`.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import AsyncIterator
from typing import Any

import numpy as np
from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from tokenmill.server.json_body import BodyError, parse_json
from tokenmill.triton import dtypes
from tokenmill.triton.backends import InferRequest
from tokenmill.triton.config import TritonModelConfig
from tokenmill.triton.decoupled import StreamItem
from tokenmill.triton.repository import ModelRepository
from tokenmill.triton.scheduling import InferError


def _error(status: int, message: str) -> JSONResponse:
    return JSONResponse({"error": message}, status_code=status)


def _flat(value: Any) -> list[Any]:
    return [x for v in value for x in _flat(v)] if isinstance(value, list) else [value]


def _check(name: str, datatype: str, value: Any) -> None:
    """JSON values of the input's type: numpy would turn "false" into True, 3.7 into 3, null into NaN."""
    for v in _flat(value):
        if isinstance(v, dict):
            raise InferError(400, f"{name!r}: an object is not a tensor value")
        if datatype == "BYTES":
            continue
        bad = v is None or isinstance(v, str)
        if datatype == "BOOL":
            bad = bad or not (isinstance(v, bool) or v in (0, 1))
        elif datatype.startswith(("INT", "UINT")):
            bad = bad or (isinstance(v, float) and not v.is_integer())
        if bad:
            raise InferError(400, f"{name!r}: {json.dumps(v)} is not a {datatype} value")


def _tensor(cfg: TritonModelConfig, name: str, value: Any) -> np.ndarray:
    spec = cfg.input(name)
    assert spec is not None
    _check(name, spec.datatype, value)
    data = value if isinstance(value, list) else [value]
    try:
        if spec.datatype == "BYTES":
            flat = np.array(data, dtype=object)
            arr = np.vectorize(_to_bytes, otypes=[object])(flat) if flat.size else flat
        else:
            arr = np.array(data, dtype=dtypes.NUMPY[spec.datatype])
    except (ValueError, TypeError, OverflowError) as e:
        raise InferError(400, f"{name!r}: not a {spec.datatype} value: {e}") from None
    if arr.dtype == object and spec.datatype != "BYTES":
        raise InferError(400, f"{name!r}: a ragged list is not a tensor")
    return arr[np.newaxis] if cfg.batched else arr


def _to_bytes(v: Any) -> bytes:
    if isinstance(v, str):
        return v.encode()
    if isinstance(v, bool | int | float):
        return str(v).encode()
    raise TypeError(f"{type(v).__name__} is not a string")


def _request(cfg: TritonModelConfig, body: dict[str, Any]) -> InferRequest:
    params = body.get("parameters", {})
    if not isinstance(params, dict):
        raise InferError(400, "'parameters' must be an object")
    inputs: dict[str, np.ndarray] = {}
    extra: dict[str, Any] = {}
    for key, value in body.items():
        if key in ("parameters", "id"):
            continue
        if cfg.input(key) is not None:
            inputs[key] = _tensor(cfg, key, value)
        elif isinstance(value, str | int | float):  # bool is an int
            extra[key] = value
        else:
            names = ", ".join(t.name for t in cfg.inputs)
            raise InferError(
                400, f"{key!r} is neither an input of model {cfg.name!r} ({names}) nor a parameter"
            )
    for k, v in params.items():
        if not isinstance(v, str | int | float):
            raise InferError(400, f"parameter {k!r} must be a string, a number or a boolean")
    try:
        return InferRequest.from_protocol(inputs, None, {**extra, **params}, str(body.get("id", "")))
    except (TypeError, ValueError, OverflowError):
        raise InferError(400, "priority and timeout parameters must be integers") from None


def _value(arr: np.ndarray) -> Any:
    """A one-element tensor as its value, others as nested lists; BYTES as text."""
    flat = arr.reshape(-1)
    if arr.dtype == object:
        text = [b.decode(errors="replace") if isinstance(b, bytes) else b for b in flat]
        return text[0] if len(text) == 1 else np.array(text, dtype=object).reshape(arr.shape).tolist()
    return flat[0].item() if flat.size == 1 else arr.tolist()


def _answer(name: str, version: str, req_id: str, outputs: dict[str, np.ndarray]) -> dict[str, Any]:
    d: dict[str, Any] = {"model_name": name, "model_version": version}
    if req_id:
        d["id"] = req_id
    for n, a in outputs.items():
        d[n] = _value(np.asarray(a))
    return d


async def _body(request: Request) -> dict[str, Any]:
    try:
        d = parse_json(await request.body())
    except BodyError as e:
        raise InferError(400, str(e)) from None
    if not isinstance(d, dict):
        raise InferError(400, "a generate request is a JSON object")
    return d


def add_generate_routes(r: APIRouter, repo: ModelRepository) -> None:
    async def generate(name: str, request: Request, version: str | None = None) -> Response:
        from tokenmill.server.app import _cancel_on_disconnect  # (app imports this module lazily)

        try:
            v = repo.get(name, version)
            req = _request(v.cfg, await _body(request))
            # A client that goes away cancels the request (for the LLM: aborts it in the engine).
            out = await _cancel_on_disconnect(request, repo.infer(name, version, req))
        except InferError as e:
            return _error(e.status, e.message)
        return JSONResponse(_answer(name, v.version, req.request_id, out))

    async def generate_stream(name: str, request: Request, version: str | None = None) -> Response:
        from tokenmill.server.app import _cancel_on_disconnect

        try:
            v = repo.get(name, version)
            req = _request(v.cfg, await _body(request))
            items = repo.infer_stream(name, version, req)
            # The first response (or an early error) before the 200: a request the model refuses
            # at once gets a plain JSON error, as the extension says.
            first = await _cancel_on_disconnect(request, anext(items, None))
        except InferError as e:
            return _error(e.status, e.message)
        if first is not None and first.error is not None and first.final:
            await items.aclose()
            return _error(first.status, first.error)

        async def events() -> AsyncIterator[bytes]:
            async with contextlib.aclosing(items):
                item: StreamItem | None = first
                while item is not None:
                    if item.error is not None:
                        yield _event({"error": item.error})
                    elif item.outputs is not None:
                        yield _event(_answer(name, v.version, req.request_id, item.outputs))
                    item = await anext(items, None)

        return StreamingResponse(events(), media_type="text/event-stream; charset=utf-8")

    for route, fn in (("generate", generate), ("generate_stream", generate_stream)):
        r.add_api_route(f"/v2/models/{{name}}/{route}", fn, methods=["POST"])
        r.add_api_route(f"/v2/models/{{name}}/versions/{{version}}/{route}", fn, methods=["POST"])


def _event(d: dict[str, Any]) -> bytes:
    return b"data: " + json.dumps(d).encode() + b"\n\n"
