"""KServe v2 over HTTP (Triton's routes): health, metadata, config, infer (JSON and binary tensors),
repository index / load / unload, statistics. Errors are {"error": message} with the protocol's codes.
"""

from __future__ import annotations

import asyncio
import json
import zlib
from typing import Any

import numpy as np
from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response
from fastapi.routing import APIRoute
from starlette.routing import Match

import tokenmill
from tokenmill.server.json_body import BodyError, parse_json
from tokenmill.triton import dtypes
from tokenmill.triton.backends import InferRequest
from tokenmill.triton.generate import add_generate_routes
from tokenmill.triton.repository import ModelRepository
from tokenmill.triton.scheduling import InferError
from tokenmill.triton.shm import CUDA_NEEDS_GPU, TensorRef, read_input, registry, tensor_ref, write_outputs

EXTENSIONS = [
    "model_repository",
    "model_repository(unload_dependents)",
    "model_configuration",
    "schedule_policy",
    "sequence",
    "binary_tensor_data",
    "parameters",
    "statistics",
    "system_shared_memory",
]
HEADER_LEN = "inference-header-content-length"


def _error(status: int, message: str) -> JSONResponse:
    return JSONResponse({"error": message}, status_code=status)


def build_router(repo: ModelRepository, max_body_bytes: int = 64 * 2**20) -> APIRouter:
    r = APIRouter()

    @r.get("/v2/health/live")
    async def live() -> Response:
        return Response(status_code=200)

    @r.get("/v2/health/ready")
    async def ready() -> Response:
        return Response(status_code=200 if repo.all_ready() else 400)

    @r.get("/v2")
    async def server_metadata() -> dict:
        return {"name": "tokenmill", "version": tokenmill.__version__, "extensions": EXTENSIONS}

    @r.post("/v2/repository/index")
    async def index(request: Request) -> Response:
        body = await request.body()
        ready_only = False
        if body.strip():
            try:
                d = parse_json(body)
            except BodyError:
                d = None
            if not isinstance(d, dict):
                return _error(400, "repository index body must be a JSON object")
            ready_only = d.get("ready", False)
            if not isinstance(ready_only, bool):
                return _error(400, "'ready' must be a boolean")
        return JSONResponse(repo.index(ready_only))

    @r.post("/v2/repository/models/{name}/load")
    async def load(name: str, request: Request) -> Response:
        params = await _params(request)
        if params is None:
            return _error(400, "load body must be a JSON object")
        if any(k.startswith("file:") or k == "config" for k in params):
            return _error(400, "loading with a config or file overrides is not supported by tokenmill")
        try:
            await repo.load(name)
        except InferError as e:
            return _error(e.status, e.message)
        return Response(status_code=200)

    @r.post("/v2/repository/models/{name}/unload")
    async def unload(name: str, request: Request) -> Response:
        params = await _params(request)
        if params is None:
            return _error(400, "unload body must be a JSON object")
        try:
            await repo.unload(name, bool(params.get("unload_dependents", False)))
        except InferError as e:
            return _error(e.status, e.message)
        return Response(status_code=200)

    @r.get("/v2/models/stats")
    async def all_stats() -> dict:
        return {
            "model_stats": [v.stats.to_json() for e in repo.entries.values() for v in e.versions.values()]
        }

    def _routes(suffix: str, method: str):
        def deco(fn):
            getattr(r, method)(f"/v2/models/{{name}}{suffix}")(fn)
            getattr(r, method)(f"/v2/models/{{name}}/versions/{{version}}{suffix}")(fn)
            return fn

        return deco

    @_routes("/stats", "get")
    async def stats(name: str, version: str | None = None) -> Response:
        try:
            if version is None:
                e = repo.entries.get(name)
                if e is None or not e.versions:
                    repo.get(name)  # raises the right error
                return JSONResponse({"model_stats": [v.stats.to_json() for v in e.versions.values()]})
            return JSONResponse({"model_stats": [repo.get(name, version).stats.to_json()]})
        except InferError as e:
            return _error(e.status, e.message)

    @_routes("/ready", "get")
    async def model_ready(name: str, version: str | None = None) -> Response:
        return Response(status_code=200 if repo.ready(name, version) else 400)

    @_routes("/config", "get")
    async def config(name: str, version: str | None = None) -> Response:
        try:
            return JSONResponse(repo.get(name, version).cfg.to_json())
        except InferError as e:
            return _error(e.status, e.message)

    @_routes("", "get")
    async def model_metadata(name: str, version: str | None = None) -> Response:
        try:
            v = repo.get(name, version)
        except InferError as e:
            return _error(e.status, e.message)
        cfg = v.cfg
        versions = sorted(repo.entries[name].versions, key=int)
        return JSONResponse(
            {
                "name": name,
                "versions": versions,
                "platform": cfg.platform or cfg.backend,
                "inputs": [t.metadata(cfg.batched) for t in cfg.inputs],
                "outputs": [t.metadata(cfg.batched) for t in cfg.outputs],
            }
        )

    @_routes("/infer", "post")
    async def infer(name: str, request: Request, version: str | None = None) -> Response:
        try:
            raw = await request.body()
            encoding = request.headers.get("content-encoding")
            # Off the event loop: inflating even up to the limit takes a while, and health checks wait.
            body = await asyncio.to_thread(_decompress, raw, encoding, max_body_bytes) if encoding else raw
            req, binary_out, req_id, shm_out = _parse_infer(
                repo, name, version, body, request.headers.get(HEADER_LEN)
            )
            v = repo.get(name, version)
            out = await repo.infer(name, version, req)
            write_outputs(shm_out, out)
        except InferError as e:
            return _error(e.status, e.message)
        return _infer_response(name, v.version, req_id, out, binary_out, shm_out)

    _add_shared_memory_routes(r, repo)

    add_generate_routes(r, repo)  # generate, generate_stream (triton/generate.py)
    _unsupported_and_unknown_routes(r)
    return r


# Triton's route families that tokenmill does not implement, and what their 400 says.
UNSUPPORTED = {
    "/v2/trace": "trace settings are not supported by tokenmill",
    "/v2/models/{name}/trace": "trace settings are not supported by tokenmill",
    "/v2/models/{name}/versions/{version}/trace": "trace settings are not supported by tokenmill",
    "/v2/logging": "log settings are not supported by tokenmill",
}
METHODS = ["GET", "HEAD", "POST", "PUT", "PATCH", "DELETE", "OPTIONS"]


def _add_shared_memory_routes(r: APIRouter, repo: ModelRepository) -> None:
    """Triton's shared-memory extension: system regions (triton/shm.py, one registry with the gRPC
    front); CUDA regions need a GPU, so there are never any, and unregistering them is a no-op (as on
    a Triton built without GPUs: perf_analyzer unregisters both kinds at start and at exit)."""
    regions = registry(repo)
    system, cuda = "/v2/systemsharedmemory", "/v2/cudasharedmemory"

    def system_status(name: str) -> Response:
        try:
            return JSONResponse(regions.status(name))
        except InferError as e:
            return _error(e.status, e.message)

    @r.get(f"{system}/status")
    async def system_status_all() -> Response:
        return system_status("")

    @r.get(f"{system}/region/{{name}}/status")
    async def system_status_one(name: str) -> Response:
        return system_status(name)

    @r.post(f"{system}/region/{{name}}/register")
    async def system_register(name: str, request: Request) -> Response:
        try:
            d = parse_json(await request.body())
        except BodyError:
            d = None
        if not isinstance(d, dict):
            return _error(400, "a register request needs a JSON object: 'key', 'offset', 'byte_size'")
        for field in ("key", "byte_size"):
            if field not in d:
                return _error(400, f"Shared memory register request has no {field!r} field")
        key, offset, size = d["key"], d.get("offset", 0), d["byte_size"]
        if not isinstance(key, str):
            return _error(400, "'key' must be a string")
        if not (_is_int(offset) and _is_int(size) and offset >= 0 and size >= 0):
            return _error(400, "'offset' and 'byte_size' must be non-negative integers")
        try:
            regions.register(name, key, offset, size)
        except InferError as e:
            return _error(e.status, e.message)
        return Response(status_code=200)

    def system_unregister(name: str) -> Response:
        try:
            regions.unregister(name)
        except InferError as e:
            return _error(e.status, e.message)
        return Response(status_code=200)

    @r.post(f"{system}/unregister")
    async def system_unregister_all() -> Response:
        return system_unregister("")

    @r.post(f"{system}/region/{{name}}/unregister")
    async def system_unregister_one(name: str) -> Response:
        return system_unregister(name)

    @r.get(f"{cuda}/status")
    async def cuda_status_all() -> Response:
        return JSONResponse([])

    @r.get(f"{cuda}/region/{{name}}/status")
    async def cuda_status_one(name: str) -> Response:
        return _error(404, f"Unable to find cuda shared memory region: {name!r}")

    @r.post(f"{cuda}/region/{{name}}/register")
    async def cuda_register(name: str) -> Response:
        return _error(400, CUDA_NEEDS_GPU)

    @r.post(f"{cuda}/unregister")
    @r.post(f"{cuda}/region/{{name}}/unregister")
    async def cuda_unregister() -> Response:
        return Response(status_code=200)


def _unsupported_and_unknown_routes(r: APIRouter) -> None:
    """Every other path and method under /v2 answers in the protocol's shape, {"error": ...}: FastAPI's
    own 404 and 405 ({"detail": ...}) make tritonclient and perf_analyzer fail decoding the answer.
    Registered after every /v2 route, so they see only what no route took. They live on this router,
    not in an app-wide handler, so the /v2 shape does not depend on the OpenAI routes' handlers."""

    def unsupported(message: str):
        async def answer() -> Response:
            return _error(400, message)

        return answer

    for prefix, message in UNSUPPORTED.items():
        for path in (prefix, prefix + "/{rest:path}"):
            r.add_api_route(path, unsupported(message), methods=METHODS, include_in_schema=False)
    served = [route for route in r.routes if isinstance(route, APIRoute)]

    async def unknown(request: Request) -> Response:
        # A route that matches the path but not the method makes this a 405, as Starlette would answer.
        allowed = sorted(
            {m for route in served if route.matches(request.scope)[0] == Match.PARTIAL for m in route.methods}
        )
        method, path = request.method, request.url.path
        if allowed:
            allow = ", ".join(allowed)
            response = _error(405, f"method {method} is not allowed on {path} (allowed: {allow})")
            response.headers["Allow"] = allow
            return response
        return _error(404, f"no such KServe v2 / Triton route: {method} {path}")

    for path in ("/v2", "/v2/{rest:path}"):
        r.add_api_route(path, unknown, methods=METHODS, include_in_schema=False)


async def _params(request: Request) -> dict | None:
    body = await request.body()
    if not body.strip():
        return {}
    try:
        d = parse_json(body)
    except BodyError:  # not JSON, too deep, an integer past Python's digit limit
        return None
    if not isinstance(d, dict):
        return None
    p = d.get("parameters", {})
    return p if isinstance(p, dict) else None


def _decompress(body: bytes, encoding: str | None, limit: int) -> bytes:
    """gzip/deflate bodies inflated in pieces, stopping as soon as the output passes `limit`: a body of
    1 MB that inflates to 1 GB costs at most `limit` bytes and the time to produce them."""
    if encoding not in ("gzip", "deflate"):
        return body
    # A gzip member ends with its inflated size mod 2**32 (RFC 1952 ISIZE). The true size is that plus a
    # multiple of 2**32, so a trailer above the limit proves the body inflates past it: refuse at once,
    # without inflating anything. A forged or wrapped trailer falls through to the capped inflation below.
    if encoding == "gzip" and len(body) >= 18 and body[:3] == b"\x1f\x8b\x08":
        declared = int.from_bytes(body[-4:], "little")
        if declared > limit:
            msg = f"the gzip request body declares {declared} inflated bytes, past the limit of {limit}"
            raise InferError(413, msg)
    # Two passes: the first only counts (each 1 MiB piece is dropped at once, so a bomb costs no memory
    # beyond one piece), the second keeps the output of a body now known to fit. Keeping pieces while
    # counting left up to `limit` bytes per worker thread in the allocator's arenas after each refusal.
    _inflate(body, encoding, limit, keep=None)
    out: list[bytes] = []
    _inflate(body, encoding, limit, keep=out)
    return b"".join(out)


def _inflate(body: bytes, encoding: str, limit: int, keep: list[bytes] | None) -> None:
    # wbits: 16 + 15 reads a gzip header, 15 a zlib (HTTP "deflate") one.
    wbits = 31 if encoding == "gzip" else 15
    size = 0

    def take(data: bytes) -> None:
        nonlocal size
        size += len(data)
        if size > limit:
            raise InferError(413, f"the {encoding} request body inflates past the limit of {limit} bytes")
        if keep is not None:
            keep.append(data)

    rest = body
    try:
        while True:  # one pass per gzip member: a gzip body may be several members back to back
            d = zlib.decompressobj(wbits=wbits)
            take(d.decompress(rest, 1 << 20))
            while d.unconsumed_tail:
                take(d.decompress(d.unconsumed_tail, 1 << 20))
            take(d.flush())
            if not d.eof:
                raise InferError(400, f"the {encoding} request body is truncated")
            rest = d.unused_data
            if encoding != "gzip" or not rest:
                break
    except zlib.error as e:
        raise InferError(400, f"cannot decompress the {encoding} request body: {e}") from None


def _parse_infer(
    repo: ModelRepository, name: str, version: str | None, body: bytes, header_len: str | None
) -> tuple[InferRequest, dict[str, bool], str, dict[str, TensorRef]]:
    """The request, which outputs go back as binary, its id, and the outputs that go into shared memory."""
    if header_len is not None:
        try:
            n = int(header_len)
        except ValueError:
            raise InferError(
                400, f"Inference-Header-Content-Length {header_len!r} is not an integer"
            ) from None
        if n == 0:
            return *_raw_binary(repo, name, version, body), {}
        head, blob = body[:n], body[n:]
    else:
        head, blob = body, b""
    try:
        d = parse_json(head)
    except BodyError as e:  # not JSON, too deep, an integer past Python's digit limit, a lone surrogate
        raise InferError(400, str(e)) from None
    if not isinstance(d, dict) or not isinstance(d.get("inputs"), list):
        raise InferError(400, "an infer request needs an 'inputs' list")
    if not isinstance(d.get("id", ""), str):
        raise InferError(400, "'id' must be a string")
    params = _parameters(d.get("parameters", {}), "'parameters'")
    regions = registry(repo)
    inputs: dict[str, np.ndarray] = {}
    pos = 0
    for t in d["inputs"]:
        tname, shape, dt = _input_head(t)
        tparams = _parameters(t.get("parameters", {}), f"input {tname!r}: 'parameters'")
        try:
            ref = tensor_ref(regions, tparams, f"input {tname!r}")
            if ref is not None:
                if "data" in t or "binary_data_size" in tparams:
                    raise InferError(
                        400,
                        f"input {tname!r} must set only one of 'data', 'binary_data_size' and "
                        "'shared_memory_region'",
                    )
                inputs[tname] = read_input(ref, dt, shape, f"input {tname!r}")
            elif "binary_data_size" in tparams:
                size = tparams["binary_data_size"]
                if not _is_int(size) or size < 0:
                    raise InferError(400, f"input {tname!r}: binary_data_size must be a non-negative integer")
                if pos + size > len(blob):
                    raise InferError(400, f"input {tname!r}: binary data ends before {size} bytes")
                inputs[tname] = dtypes.from_binary(blob[pos : pos + size], dt, shape)
                pos += size
            elif "data" in t:
                if not isinstance(t["data"], list):
                    raise InferError(400, f"input {tname!r}: 'data' must be an array")
                inputs[tname] = dtypes.from_json(t["data"], dt, shape)
            else:
                raise InferError(400, f"input {tname!r} has neither data nor binary_data_size")
        except (ValueError, TypeError, OverflowError) as e:
            raise InferError(400, f"input {tname!r}: {e}") from None
    default_binary = bool(params.get("binary_data_output", False))
    binary_out: dict[str, bool] = {}
    shm_out: dict[str, TensorRef] = {}
    requested = None
    if "outputs" in d:
        if not isinstance(d["outputs"], list):
            raise InferError(400, "'outputs' must be a list")
        requested = []
        for o in d["outputs"]:
            if not isinstance(o, dict) or not isinstance(o.get("name"), str):
                raise InferError(400, "every requested output needs a name (a string)")
            oparams = _parameters(o.get("parameters", {}), f"output {o['name']!r}: 'parameters'")
            requested.append(o["name"])
            ref = tensor_ref(regions, oparams, f"output {o['name']!r}")
            if ref is not None:
                if oparams.get("binary_data") is True:
                    raise InferError(400, "Output can't set both 'shared_memory_region' and 'binary_data'")
                shm_out[o["name"]] = ref
            binary_out[o["name"]] = bool(oparams.get("binary_data", default_binary))
    try:
        req = InferRequest.from_protocol(inputs, requested, params, str(d.get("id", "")))
    except (TypeError, ValueError, OverflowError):
        raise InferError(400, "priority and timeout parameters must be integers") from None
    if default_binary and requested is None:
        binary_out = {"*": True}
    return req, binary_out, str(d.get("id", "")), shm_out


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _parameters(p: Any, where: str) -> dict[str, Any]:
    """KServe v2 parameters: an object whose values are strings, numbers or booleans."""
    if not isinstance(p, dict):
        raise InferError(400, f"{where} must be an object")
    for k, v in p.items():
        if not isinstance(v, str | int | float):  # bool is an int
            raise InferError(400, f"{where}: {k!r} must be a string, a number or a boolean")
    return p


def _input_head(t: Any) -> tuple[str, list[int], str]:
    """An input's name, shape and datatype, each of the type KServe v2 says."""
    if not isinstance(t, dict):
        raise InferError(400, "every input must be an object with a name, a shape and a datatype")
    tname, shape, dt = t.get("name"), t.get("shape"), t.get("datatype")
    if not isinstance(tname, str):
        raise InferError(400, "every input needs a name (a string)")
    if not isinstance(shape, list) or not all(_is_int(x) and x >= 0 for x in shape):
        raise InferError(400, f"input {tname!r}: 'shape' must be a list of non-negative integers")
    if not isinstance(dt, str) or dt not in dtypes.NUMPY:
        raise InferError(400, f"input {tname!r}: unknown datatype {dt!r}")
    return tname, shape, dt


def _raw_binary(repo: ModelRepository, name: str, version: str | None, body: bytes):
    cfg = repo.get(name, version).cfg
    if len(cfg.inputs) != 1:
        raise InferError(
            400, "a raw binary request (Inference-Header-Content-Length: 0) needs a one-input model"
        )
    t = cfg.inputs[0]
    dims = [1] if t.datatype == "BYTES" else list(t.dims)
    if dims.count(-1) > 1:
        raise InferError(400, "a raw binary request needs at most one variable dimension")
    item = dtypes.NUMPY[t.datatype].itemsize if t.datatype != "BYTES" else 1
    if -1 in dims:
        known = int(np.prod([d for d in dims if d != -1])) or 1
        dims[dims.index(-1)] = len(body) // (item * known)
    shape = ([1] if cfg.batched else []) + dims
    try:
        arr = dtypes.from_binary(body, t.datatype, shape)
    except ValueError as e:
        raise InferError(400, f"raw binary input {t.name!r}: {e}") from None
    return InferRequest({t.name: arr}), {"*": True}, ""


def _infer_response(
    name: str,
    version: str,
    req_id: str,
    out: dict[str, np.ndarray],
    binary: dict[str, bool],
    shm_out: dict[str, TensorRef] | None = None,
) -> Response:
    outputs: list[dict[str, Any]] = []
    blobs: list[bytes] = []
    for oname, arr in out.items():
        entry: dict[str, Any] = {"name": oname, "datatype": dtypes.protocol_of(arr), "shape": list(arr.shape)}
        if shm_out and oname in shm_out:
            # Written into its region already. No data and no parameters, as Triton answers: Triton's
            # C++ client (perf_analyzer) fails on an output with parameters but no binary_data_size.
            pass
        elif binary.get(oname, binary.get("*", False)):
            blob = dtypes.to_binary(arr)
            entry["parameters"] = {"binary_data_size": len(blob)}
            blobs.append(blob)
        else:
            entry["data"] = dtypes.to_json(arr)
        outputs.append(entry)
    head = {"model_name": name, "model_version": version, "outputs": outputs}
    if req_id:
        head["id"] = req_id
    body = json.dumps(head).encode()
    if not blobs:
        return Response(body, media_type="application/json")
    return Response(
        body + b"".join(blobs),
        media_type="application/octet-stream",
        headers={"Inference-Header-Content-Length": str(len(body))},
    )
