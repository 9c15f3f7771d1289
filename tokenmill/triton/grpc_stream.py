"""gRPC `ModelStreamInfer`: a bidirectional stream of requests and their responses.

What tritonclient's `start_stream` / `async_stream_infer` and `perf_analyzer --streaming` speak. Each
request on the stream runs as soon as it arrives (several at once); its responses go back as they come,
matched to it by `id`. A decoupled model answers any number of times; every response carries the
`triton_final_response` parameter, and the FINAL flag sent alone is passed on as an empty response only
when the request asked with `triton_enable_empty_final_response`, as Triton does. A failure is a
response with `error_message` on the stream, which stays open for the other requests.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from typing import Any

import grpc
from tritonclient.grpc import service_pb2

from tokenmill.triton import dtypes
from tokenmill.triton.decoupled import StreamItem
from tokenmill.triton.repository import ModelRepository
from tokenmill.triton.scheduling import InferError
from tokenmill.triton.shm import registry

_DONE = object()  # a request's task has sent everything it will
_READ_ALL = object()  # the client closed its side of the stream (or it broke)


def _reply(
    request: service_pb2.ModelInferRequest, version: str, item: StreamItem
) -> service_pb2.ModelStreamInferResponse:
    """A response; an error keeps the request's id, model and final flag beside its message, as
    Triton's do, so a client with several requests on the stream knows which one failed."""
    resp = service_pb2.ModelInferResponse(model_name=request.model_name, model_version=version, id=request.id)
    resp.parameters["triton_final_response"].bool_param = item.final
    if item.error is not None:
        return service_pb2.ModelStreamInferResponse(error_message=item.error, infer_response=resp)
    for name, arr in (item.outputs or {}).items():
        resp.outputs.add(name=name, datatype=dtypes.protocol_of(arr), shape=list(arr.shape))
        resp.raw_output_contents.append(dtypes.to_binary(arr))
    return service_pb2.ModelStreamInferResponse(infer_response=resp)


def _wants_empty_final(request: service_pb2.ModelInferRequest) -> bool:
    p = request.parameters.get("triton_enable_empty_final_response")
    return p is not None and p.WhichOneof("parameter_choice") == "bool_param" and p.bool_param


async def _run_one(repo: ModelRepository, request: service_pb2.ModelInferRequest, out: asyncio.Queue) -> None:
    from tokenmill.triton.grpc_front import _request  # (grpc_front imports this module lazily)

    version = request.model_version
    try:
        if any("shared_memory_region" in o.parameters for o in request.outputs):
            raise InferError(
                400, "outputs in shared memory are not supported on ModelStreamInfer: use ModelInfer"
            )
        req = _request(request, registry(repo))
        version = repo.get(request.model_name, request.model_version or None).version
        empty_final = _wants_empty_final(request)
        async with contextlib.aclosing(
            repo.infer_stream(request.model_name, request.model_version or None, req)
        ) as items:
            async for item in items:
                if item.final and item.outputs is None and item.error is None and not empty_final:
                    continue
                await out.put(_reply(request, version, item))
    except InferError as e:
        await out.put(_reply(request, version, StreamItem(error=e.message, final=True)))
    except Exception as e:  # never a request the client waits on forever
        msg = f"model {request.model_name!r}: {type(e).__name__}: {e}"
        await out.put(_reply(request, version, StreamItem(error=msg, final=True)))
    finally:
        await out.put(_DONE)


async def model_stream_infer(
    repo: ModelRepository, requests: AsyncIterator[Any], context: grpc.aio.ServicerContext
) -> AsyncIterator[service_pb2.ModelStreamInferResponse]:
    out: asyncio.Queue = asyncio.Queue()
    running: set[asyncio.Task] = set()
    started = 0

    async def read() -> None:
        nonlocal started
        try:
            async for request in requests:
                started += 1
                task = asyncio.ensure_future(_run_one(repo, request, out))
                running.add(task)
                task.add_done_callback(running.discard)
        finally:
            await out.put(_READ_ALL)

    reader = asyncio.ensure_future(read())
    finished, read_all = 0, False
    try:
        # Until the client has closed its side and every request has sent all its responses.
        while not (read_all and finished == started):
            msg = await out.get()
            if msg is _DONE:
                finished += 1
            elif msg is _READ_ALL:
                read_all = True
            else:
                yield msg
    finally:
        reader.cancel()
        for task in list(running):
            task.cancel()
