"""The names a Triton Python-backend model imports (`import triton_python_backend_utils as pb_utils`).

Registered under that module name when the first Python model loads, so existing model.py files run
unchanged. Tensors live in host memory (numpy); BLS calls (`InferenceRequest.exec`) go back into the
server's model repository. A request's response sender (`get_response_sender`) is how a decoupled model
answers: any number of responses, the last one with TRITONSERVER_RESPONSE_COMPLETE_FINAL.
"""

from __future__ import annotations

import json
import logging
import queue
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np

from tokenmill.triton import dtypes
from tokenmill.triton.decoupled import StreamClosed, StreamItem
from tokenmill.triton.dtypes import CONFIG_TO_PROTOCOL, NUMPY, protocol_of

TRITONSERVER_REQUEST_FLAG_SEQUENCE_START = 1
TRITONSERVER_REQUEST_FLAG_SEQUENCE_END = 2
TRITONSERVER_RESPONSE_COMPLETE_FINAL = 1
TRITONSERVER_REQUEST_RELEASE_ALL = 1
TRITONSERVER_REQUEST_RELEASE_RESCHEDULE = 2

# Set by the repository, run from a model's thread: a BLS call's one response, and a decoupled BLS
# call's responses (a queue the repository fills with StreamItems, and how to cancel the call).
_bls_hook: Callable[[InferenceRequest], InferenceResponse] | None = None
_bls_stream_hook: Callable[[InferenceRequest], tuple[queue.Queue, Callable[[], None]]] | None = None


class TritonError(Exception):
    UNKNOWN, INTERNAL, NOT_FOUND, INVALID_ARG, UNAVAILABLE, UNSUPPORTED, ALREADY_EXISTS, CANCELLED = range(8)

    def __init__(self, msg: str, code: int = INTERNAL) -> None:
        super().__init__(msg)
        self._msg, self._code = msg, code

    def message(self) -> str:
        return self._msg

    def code(self) -> int:
        return self._code


class TritonModelException(Exception):
    pass


class Tensor:
    def __init__(self, name: str, array: np.ndarray) -> None:
        if not isinstance(array, np.ndarray):
            raise TritonModelException(f"Tensor {name!r} needs a numpy array, got {type(array).__name__}")
        self._name, self._array = name, array

    def name(self) -> str:
        return self._name

    def as_numpy(self) -> np.ndarray:
        return self._array

    def shape(self) -> list[int]:
        return list(self._array.shape)

    def triton_dtype(self) -> str:
        return protocol_of(self._array)

    def is_cpu(self) -> bool:
        return True

    def to_dlpack(self):
        return self._array.__dlpack__()

    @staticmethod
    def from_dlpack(name: str, capsule) -> Tensor:
        return Tensor(name, np.from_dlpack(capsule))


class InferenceRequest:
    """A request a model receives in execute(), or one it builds for a BLS call."""

    def __init__(
        self,
        model_name: str = "",
        inputs: list[Tensor] | None = None,
        requested_output_names: list[str] | None = None,
        request_id: str = "",
        correlation_id: int | str = 0,
        flags: int = 0,
        model_version: int = -1,
        parameters: dict | str | None = None,
        timeout: int = 0,
        **_: Any,
    ) -> None:
        self._model_name, self._inputs = model_name, list(inputs or [])
        self._outputs = list(requested_output_names or [])
        self._id, self._corr, self._flags, self._version = request_id, correlation_id, flags, model_version
        self._params = parameters if isinstance(parameters, str) else json.dumps(parameters or {})
        self._timeout = timeout
        self._sender: InferenceResponseSender | None = None  # set for the requests execute() receives

    def inputs(self) -> list[Tensor]:
        return self._inputs

    def requested_output_names(self) -> list[str]:
        return self._outputs

    def request_id(self) -> str:
        return self._id

    def correlation_id(self) -> int | str:
        return self._corr

    def flags(self) -> int:
        return self._flags

    def parameters(self) -> str:
        return self._params

    def timeout(self) -> int:
        return self._timeout

    def is_cancelled(self) -> bool:
        return self._sender is not None and self._sender.is_cancelled()

    @property
    def model_name(self) -> str:
        return self._model_name

    def exec(self, decoupled: bool = False) -> InferenceResponse | ResponseIterator:
        """Run the request on a model of the repository: its one response, or with decoupled=True an
        iterator over its responses (a decoupled model's many; the FINAL flag sent alone arrives as a
        last response without outputs, as Triton's iterator yields it)."""
        if decoupled:
            if _bls_stream_hook is None:
                raise TritonModelException("BLS calls need a running tokenmill server")
            q, cancel = _bls_stream_hook(self)
            return ResponseIterator(q, cancel)
        if _bls_hook is None:
            raise TritonModelException("BLS calls need a running tokenmill server")
        return _bls_hook(self)

    async def async_exec(self, decoupled: bool = False) -> InferenceResponse | ResponseIterator:
        """As exec(), awaitable; with decoupled=True it gives the same (plain) iterator, as Triton's does."""
        import asyncio

        return await asyncio.to_thread(self.exec, decoupled)

    def get_response_sender(self) -> InferenceResponseSender:
        if self._sender is None:
            raise TritonModelException("only a request that execute() received has a response sender")
        return self._sender


class InferenceResponse:
    def __init__(
        self,
        output_tensors: list[Tensor] | None = None,
        error: TritonError | None = None,
        parameters: dict | None = None,
    ) -> None:
        self._tensors, self._error, self._params = list(output_tensors or []), error, parameters or {}

    def output_tensors(self) -> list[Tensor]:
        return self._tensors

    def has_error(self) -> bool:
        return self._error is not None

    def error(self) -> TritonError | None:
        return self._error

    def parameters(self) -> str:
        return json.dumps(self._params)


def _item(response: InferenceResponse | None, final: bool) -> StreamItem:
    if response is None:
        return StreamItem(final=final)
    if not isinstance(response, InferenceResponse):
        raise TritonModelException(f"send() takes an InferenceResponse, got {type(response).__name__}")
    if response.has_error():
        err = response.error()
        return StreamItem(error=err.message() if isinstance(err, TritonError) else str(err), final=final)
    return StreamItem(outputs={t.name(): t.as_numpy() for t in response.output_tensors()}, final=final)


class InferenceResponseSender:
    """Sends a request's responses (`request.get_response_sender()`); usable from any thread, also after
    execute() has returned, until the FINAL flag."""

    def __init__(self, deliver: Callable[[StreamItem], None], cancelled: Callable[[], bool]) -> None:
        self._deliver, self._cancelled = deliver, cancelled

    def send(self, response: InferenceResponse | None = None, flags: int = 0) -> None:
        final = bool(flags & TRITONSERVER_RESPONSE_COMPLETE_FINAL)
        if response is None and not final:
            raise TritonModelException(
                "send() needs a response, or flags=TRITONSERVER_RESPONSE_COMPLETE_FINAL"
            )
        try:
            self._deliver(_item(response, final))
        except StreamClosed as e:
            raise TritonModelException(str(e)) from None

    def is_cancelled(self) -> bool:
        return self._cancelled()


def _response(item: StreamItem) -> InferenceResponse:
    if item.error is not None:
        return InferenceResponse(error=TritonError(item.error))
    return InferenceResponse([Tensor(n, a) for n, a in (item.outputs or {}).items()])


class ResponseIterator:
    """A decoupled BLS call's responses, in order, on the calling model's thread."""

    def __init__(self, q: queue.Queue, cancel: Callable[[], None]) -> None:
        self._q, self._cancel, self._done = q, cancel, False

    def __iter__(self) -> Iterator[InferenceResponse]:
        return self

    def __next__(self) -> InferenceResponse:
        if self._done:
            raise StopIteration
        item: StreamItem = self._q.get()
        self._done = item.final
        if item.final and item.outputs is None and item.error is None:
            return InferenceResponse()  # the FINAL flag alone: Triton's "last empty response"
        return _response(item)

    def cancel(self) -> None:
        self._cancel()


def get_input_tensor_by_name(request: InferenceRequest, name: str) -> Tensor | None:
    return next((t for t in request.inputs() if t.name() == name), None)


def get_output_tensor_by_name(response: InferenceResponse, name: str) -> Tensor | None:
    return next((t for t in response.output_tensors() if t.name() == name), None)


def get_input_config_by_name(model_config: dict, name: str) -> dict | None:
    return next((t for t in model_config.get("input", []) if t.get("name") == name), None)


def get_output_config_by_name(model_config: dict, name: str) -> dict | None:
    return next((t for t in model_config.get("output", []) if t.get("name") == name), None)


def triton_string_to_numpy(type_string: str) -> type:
    return NUMPY[CONFIG_TO_PROTOCOL[type_string]].type


def triton_to_numpy_type(datatype: str) -> type:
    return NUMPY[datatype.removeprefix("TYPE_") if datatype.startswith("TYPE_") else datatype].type


def numpy_to_triton_type(dtype: Any) -> str:
    return protocol_of(np.empty(0, dtype=dtype))


def serialize_byte_tensor(arr: np.ndarray) -> np.ndarray:
    return np.frombuffer(dtypes.to_binary(np.asarray(arr, dtype=object)), dtype=np.uint8)


def deserialize_bytes_tensor(encoded: bytes) -> np.ndarray:
    return dtypes.bytes_elements(bytes(encoded))


def using_decoupled_model_transaction_policy(model_config: dict) -> bool:
    return bool(model_config.get("model_transaction_policy", {}).get("decoupled"))


class Logger:
    _log = logging.getLogger("tokenmill.triton.model")

    @classmethod
    def log_info(cls, msg: str) -> None:
        cls._log.info(msg)

    @classmethod
    def log_warn(cls, msg: str) -> None:
        cls._log.warning(msg)

    @classmethod
    def log_error(cls, msg: str) -> None:
        cls._log.error(msg)

    @classmethod
    def log_verbose(cls, msg: str) -> None:
        cls._log.debug(msg)
