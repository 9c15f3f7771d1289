"""KServe v2 over gRPC (Triton's `inference.GRPCInferenceService`, port 8001 by default).

The message and service classes are the generated ones shipped in the `tritonclient[grpc]` package,
so the wire format is exactly what Triton's own clients speak. Unary calls only: health, metadata,
config, infer (typed contents or raw_input_contents; outputs always as raw_output_contents),
statistics and the repository calls; ModelStreamInfer (decoupled streaming) is not offered.
"""

from __future__ import annotations

import hmac
from collections.abc import Awaitable, Callable
from typing import Any

import grpc
import numpy as np
from google.protobuf import json_format
from tritonclient.grpc import model_config_pb2, service_pb2, service_pb2_grpc

import tokenmill
from tokenmill.server.tenants import plain_keys
from tokenmill.triton import dtypes
from tokenmill.triton.backends import InferRequest
from tokenmill.triton.http import EXTENSIONS, UNSUPPORTED
from tokenmill.triton.repository import ModelRepository
from tokenmill.triton.scheduling import InferError
from tokenmill.triton.shm import (
    CUDA_NEEDS_GPU,
    Registry,
    ShmError,
    TensorRef,
    read_input,
    registry,
    tensor_ref,
    write_outputs,
)

_STATUS = {
    400: grpc.StatusCode.INVALID_ARGUMENT,
    404: grpc.StatusCode.NOT_FOUND,
    503: grpc.StatusCode.UNAVAILABLE,
    500: grpc.StatusCode.INTERNAL,
}
# InferTensorContents field for each datatype.
_CONTENTS = {
    "BOOL": "bool_contents",
    "INT8": "int_contents",
    "INT16": "int_contents",
    "INT32": "int_contents",
    "INT64": "int64_contents",
    "UINT8": "uint_contents",
    "UINT16": "uint_contents",
    "UINT32": "uint_contents",
    "UINT64": "uint64_contents",
    "FP32": "fp32_contents",
    "FP64": "fp64_contents",
    "BYTES": "bytes_contents",
}


def _param(p: service_pb2.InferParameter) -> Any:
    kind = p.WhichOneof("parameter_choice")
    return getattr(p, kind) if kind else None


async def _abort(context: grpc.aio.ServicerContext, e: InferError) -> None:
    await context.abort(_STATUS.get(e.status, grpc.StatusCode.UNKNOWN), e.message)


def _unsupported(route: str) -> Callable[..., Awaitable[None]]:
    """A call of Triton's that tokenmill does not implement: UNIMPLEMENTED, saying so as HTTP's 400 does."""

    async def call(self: Servicer, request: Any, context: grpc.aio.ServicerContext) -> None:
        await context.abort(grpc.StatusCode.UNIMPLEMENTED, UNSUPPORTED[route])

    return call


class Servicer(service_pb2_grpc.GRPCInferenceServiceServicer):
    def __init__(self, repo: ModelRepository) -> None:
        self.repo = repo

    # Triton's shared-memory extension: system regions in the registry the HTTP front shares
    # (triton/shm.py); CUDA regions need a GPU, so there are none, and unregistering is a no-op.
    async def SystemSharedMemoryStatus(self, request, context):  # noqa: N802
        try:
            regions = registry(self.repo).status(request.name)
        except InferError as e:
            await _abort_shm(context, e)
        resp = service_pb2.SystemSharedMemoryStatusResponse()
        for s in regions:
            resp.regions[s["name"]].CopyFrom(service_pb2.SystemSharedMemoryStatusResponse.RegionStatus(**s))
        return resp

    async def SystemSharedMemoryRegister(self, request, context):  # noqa: N802
        try:
            registry(self.repo).register(request.name, request.key, request.offset, request.byte_size)
        except InferError as e:
            await _abort_shm(context, e)
        return service_pb2.SystemSharedMemoryRegisterResponse()

    async def SystemSharedMemoryUnregister(self, request, context):  # noqa: N802
        try:
            registry(self.repo).unregister(request.name)
        except InferError as e:
            await _abort_shm(context, e)
        return service_pb2.SystemSharedMemoryUnregisterResponse()

    async def CudaSharedMemoryStatus(self, request, context):  # noqa: N802
        if request.name:
            msg = f"Unable to find cuda shared memory region: {request.name!r}"
            await context.abort(grpc.StatusCode.NOT_FOUND, msg)
        return service_pb2.CudaSharedMemoryStatusResponse()

    async def CudaSharedMemoryRegister(self, request, context):  # noqa: N802
        await context.abort(grpc.StatusCode.INVALID_ARGUMENT, CUDA_NEEDS_GPU)

    async def CudaSharedMemoryUnregister(self, request, context):  # noqa: N802
        return service_pb2.CudaSharedMemoryUnregisterResponse()

    TraceSetting = _unsupported("/v2/trace")
    LogSettings = _unsupported("/v2/logging")

    async def ModelStreamInfer(self, request_iterator, context):  # noqa: N802
        from tokenmill.triton.grpc_stream import model_stream_infer  # (it imports this module's parsing)

        async for response in model_stream_infer(self.repo, request_iterator, context):
            yield response

    async def ServerLive(self, request, context):  # noqa: N802 (the service's method names)
        return service_pb2.ServerLiveResponse(live=True)

    async def ServerReady(self, request, context):  # noqa: N802
        return service_pb2.ServerReadyResponse(ready=self.repo.all_ready())

    async def ModelReady(self, request, context):  # noqa: N802
        return service_pb2.ModelReadyResponse(ready=self.repo.ready(request.name, request.version or None))

    async def ServerMetadata(self, request, context):  # noqa: N802
        return service_pb2.ServerMetadataResponse(
            name="tokenmill", version=tokenmill.__version__, extensions=EXTENSIONS
        )

    async def ModelMetadata(self, request, context):  # noqa: N802
        try:
            v = self.repo.get(request.name, request.version or None)
        except InferError as e:
            await _abort(context, e)
        cfg = v.cfg
        tm = service_pb2.ModelMetadataResponse.TensorMetadata
        return service_pb2.ModelMetadataResponse(
            name=cfg.name,
            versions=sorted(self.repo.entries[cfg.name].versions, key=int),
            platform=cfg.platform or cfg.backend,
            inputs=[tm(**t.metadata(cfg.batched)) for t in cfg.inputs],
            outputs=[tm(**t.metadata(cfg.batched)) for t in cfg.outputs],
        )

    async def ModelConfig(self, request, context):  # noqa: N802
        try:
            v = self.repo.get(request.name, request.version or None)
        except InferError as e:
            await _abort(context, e)
        cfg = json_format.ParseDict(
            v.cfg.to_json(), model_config_pb2.ModelConfig(), ignore_unknown_fields=True
        )
        return service_pb2.ModelConfigResponse(config=cfg)

    async def ModelStatistics(self, request, context):  # noqa: N802
        try:
            if request.name:
                versions = (
                    [self.repo.get(request.name, request.version)]
                    if request.version
                    else list(self.repo.entries[request.name].versions.values())
                )
                if not versions:
                    self.repo.get(request.name)
            else:
                versions = [v for e in self.repo.entries.values() for v in e.versions.values()]
        except (InferError, KeyError) as e:
            await _abort(context, e if isinstance(e, InferError) else InferError(404, f"unknown model: {e}"))
        stats = [{k: val for k, val in v.stats.to_json().items()} for v in versions]
        return json_format.ParseDict(
            {"model_stats": stats}, service_pb2.ModelStatisticsResponse(), ignore_unknown_fields=True
        )

    async def RepositoryIndex(self, request, context):  # noqa: N802
        idx = service_pb2.RepositoryIndexResponse.ModelIndex
        return service_pb2.RepositoryIndexResponse(models=[idx(**m) for m in self.repo.index(request.ready)])

    async def RepositoryModelLoad(self, request, context):  # noqa: N802
        if any(k == "config" or k.startswith("file:") for k in request.parameters):
            await _abort(context, InferError(400, "loading with config or file overrides is not supported"))
        try:
            await self.repo.load(request.model_name)
        except InferError as e:
            await _abort(context, e)
        return service_pb2.RepositoryModelLoadResponse()

    async def RepositoryModelUnload(self, request, context):  # noqa: N802
        deps = request.parameters.get("unload_dependents")
        try:
            await self.repo.unload(request.model_name, bool(deps and _param(deps)))
        except InferError as e:
            await _abort(context, e)
        return service_pb2.RepositoryModelUnloadResponse()

    async def ModelInfer(self, request, context):  # noqa: N802
        try:
            regions = registry(self.repo)
            req = _request(request, regions)
            shm_out = _output_refs(request, regions)
            v = self.repo.get(request.model_name, request.model_version or None)
            out = await self.repo.infer(request.model_name, request.model_version or None, req)
            write_outputs(shm_out, out)
        except InferError as e:
            await _abort(context, e)
        resp = service_pb2.ModelInferResponse(
            model_name=request.model_name, model_version=v.version, id=request.id
        )
        for name, arr in out.items():
            resp.outputs.add(name=name, datatype=dtypes.protocol_of(arr), shape=list(arr.shape))
            # An output in shared memory keeps its place in raw_output_contents, empty, as Triton's
            # does: clients find an output's contents by its index among the outputs.
            resp.raw_output_contents.append(b"" if name in shm_out else dtypes.to_binary(arr))
        return resp


# Triton's error kinds that have a gRPC code but no HTTP one of their own (HTTP answers them with 400).
_SHM_STATUS = {"ALREADY_EXISTS": grpc.StatusCode.ALREADY_EXISTS, "UNSUPPORTED": grpc.StatusCode.UNIMPLEMENTED}


async def _abort_shm(context: grpc.aio.ServicerContext, e: InferError) -> None:
    code = _SHM_STATUS.get(e.kind) if isinstance(e, ShmError) else None
    if code is not None:
        await context.abort(code, e.message)
    await _abort(context, e)


def _tensor_params(t: Any) -> dict[str, Any]:
    return {k: _param(p) for k, p in t.parameters.items()}


def _output_refs(r: service_pb2.ModelInferRequest, regions: Registry) -> dict[str, TensorRef]:
    """The requested outputs that go into shared memory, and where."""
    refs = {}
    for o in r.outputs:
        ref = tensor_ref(regions, _tensor_params(o), f"output {o.name!r}")
        if ref is not None:
            refs[o.name] = ref
    return refs


def _request(r: service_pb2.ModelInferRequest, regions: Registry | None = None) -> InferRequest:
    """The request's inputs from typed contents, raw_input_contents or shared memory. `regions`: the
    server's shared-memory registry (triton/shm.py `registry(repo)`); without it an input in shared
    memory is refused."""
    inputs: dict[str, np.ndarray] = {}
    refs = [_input_ref(t, regions) for t in r.inputs]
    raw = list(r.raw_input_contents)
    # raw_input_contents has one entry per input that is not in shared memory (what tritonclient sends).
    plain = sum(ref is None for ref in refs)
    if raw and len(raw) != plain:
        raise InferError(400, f"{len(raw)} raw_input_contents for {plain} inputs not in shared memory")
    next_raw = 0
    for t, ref in zip(r.inputs, refs, strict=True):
        if t.datatype not in dtypes.NUMPY:
            raise InferError(400, f"input {t.name!r}: unknown datatype {t.datatype!r}")
        shape = list(t.shape)
        try:
            if ref is not None:
                if t.HasField("contents"):
                    raise InferError(400, f"input {t.name!r}: unexpected 'contents' with shared memory")
                inputs[t.name] = read_input(ref, t.datatype, shape, f"input {t.name!r}")
            elif raw:
                inputs[t.name] = dtypes.from_binary(raw[next_raw], t.datatype, shape)
                next_raw += 1
            else:
                values = list(getattr(t.contents, _CONTENTS[t.datatype]))
                if t.datatype == "BYTES":
                    arr = np.array(values, dtype=object)
                    inputs[t.name] = arr.reshape(shape)
                else:
                    inputs[t.name] = dtypes.from_json(values, t.datatype, shape)
        except ValueError as e:
            raise InferError(400, f"input {t.name!r}: {e}") from None
    params = {k: _param(p) for k, p in r.parameters.items()}
    try:
        return InferRequest.from_protocol(inputs, [o.name for o in r.outputs] or None, params, r.id)
    except (TypeError, ValueError, OverflowError):
        raise InferError(400, "priority and timeout parameters must be integers") from None


def _input_ref(
    t: service_pb2.ModelInferRequest.InferInputTensor, regions: Registry | None
) -> TensorRef | None:
    params = _tensor_params(t)
    if regions is None:
        if any(k.startswith("shared_memory_") for k in params):
            raise InferError(400, f"input {t.name!r}: shared memory inputs are not supported on this call")
        return None
    return tensor_ref(regions, params, f"input {t.name!r}")


# Health stays open with a key set, as on HTTP: probes carry no credentials.
OPEN_METHODS = {"ServerLive", "ServerReady"}


class ApiKeyInterceptor(grpc.aio.ServerInterceptor):
    """`authorization: Bearer <key>` metadata on every call but the health ones (what tritonclient
    sends with `headers={"authorization": ...}`), as the HTTP front requires the same header.

    `keys`: the keys accepted, as the HTTP front's (server/tenants.py key_table: plain and named), or
    --api-key's text (comma-separated plain keys). A key's name changes nothing here: the repository's
    models do not run in the LLM engine, so there are no tenants to serve them for."""

    def __init__(self, keys: str | list[tuple[str | None, bytes]]) -> None:
        table = [(None, k.encode()) for k in plain_keys(keys)] if isinstance(keys, str) else keys
        self.expected = [b"Bearer " + k for _, k in table]

        async def deny(request: Any, context: grpc.aio.ServicerContext) -> None:
            msg = "invalid or missing API key: send `authorization: Bearer <key>`"
            await context.abort(grpc.StatusCode.UNAUTHENTICATED, msg)

        self._deny = grpc.unary_unary_rpc_method_handler(deny)

    async def intercept_service(self, continuation, details: grpc.HandlerCallDetails):  # noqa: ANN001, ANN201
        if details.method.rsplit("/", 1)[-1] in OPEN_METHODS:
            return await continuation(details)
        auth = dict(details.invocation_metadata or ()).get("authorization", "")
        presented = auth.encode() if isinstance(auth, str) else auth
        if any([hmac.compare_digest(presented, k) for k in self.expected]):
            return await continuation(details)
        return self._deny


async def start_grpc(
    repo: ModelRepository, host: str, port: int, api_key: str | None = None
) -> grpc.aio.Server:
    """The KServe v2 gRPC front. Its keys: those the HTTP app gave the repository (`api_keys`, plain and
    named: server/app.py), else `api_key` (comma-separated plain keys)."""
    keys = getattr(repo, "api_keys", None) or api_key
    server = grpc.aio.server(interceptors=[ApiKeyInterceptor(keys)] if keys else None)
    service_pb2_grpc.add_GRPCInferenceServiceServicer_to_server(Servicer(repo), server)
    if server.add_insecure_port(f"{host}:{port}") == 0:
        raise ValueError(f"cannot listen for gRPC on {host}:{port}")
    await server.start()
    return server
