"""Model backends: Python (Triton's TritonPythonModel interface), ONNX Runtime, and PyTorch.

An instance executes one batch at a time, on a worker thread of the server (ONNX Runtime and PyTorch
release the GIL while computing, and so does a Python model that waits). A batch is a list of
requests; tensor backends concatenate them along the batch dimension and split the outputs again.
"""

from __future__ import annotations

import asyncio
import importlib.util
import inspect
import json
import sys
import threading
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from tokenmill.extras import require
from tokenmill.triton.config import TritonModelConfig
from tokenmill.triton.decoupled import ResponseStream, StreamItem
from tokenmill.triton.stats import RequestTimes


class ModelError(Exception):
    """A failure of the model's own code or files (reported as the protocol's INTERNAL error)."""


@dataclass
class InferRequest:
    inputs: dict[str, np.ndarray]
    requested_outputs: list[str] | None = None
    parameters: dict[str, Any] = field(default_factory=dict)
    request_id: str = ""
    correlation_id: int | str = 0
    flags: int = 0
    priority: int = 0
    timeout_us: int = 0
    # Filled in as the request runs; an ensemble adds its steps' into its own statistics.
    times: RequestTimes = field(default_factory=RequestTimes, compare=False, repr=False)
    # Where a decoupled model's responses go (set by the repository for every request to one).
    stream: ResponseStream | None = field(default=None, compare=False, repr=False)
    # Set when the caller takes exactly one response (infer on a decoupled model, an ensemble step):
    # a model that can refuse to stream before it runs does.
    one_response: bool = field(default=False, compare=False, repr=False)

    @classmethod
    def from_protocol(
        cls, inputs: dict[str, np.ndarray], outputs: list[str] | None, params: dict[str, Any], request_id: str
    ) -> InferRequest:
        """A request from KServe v2 parameters (sequence_id/start/end, priority, timeout)."""
        from tokenmill.triton.pb_utils import (
            TRITONSERVER_REQUEST_FLAG_SEQUENCE_END,
            TRITONSERVER_REQUEST_FLAG_SEQUENCE_START,
        )

        flags = (TRITONSERVER_REQUEST_FLAG_SEQUENCE_START if params.get("sequence_start") else 0) | (
            TRITONSERVER_REQUEST_FLAG_SEQUENCE_END if params.get("sequence_end") else 0
        )
        return cls(
            inputs,
            outputs,
            parameters={k: v for k, v in params.items() if not k.startswith("binary_data")},
            request_id=request_id,
            correlation_id=params.get("sequence_id", 0) or 0,
            flags=flags,
            priority=int(params.get("priority", 0) or 0),
            timeout_us=int(params.get("timeout", 0) or 0),
        )

    def batch_size(self, cfg: TritonModelConfig) -> int:
        if not cfg.batched or not self.inputs:
            return 1
        return int(next(iter(self.inputs.values())).shape[0])


Outputs = dict[str, np.ndarray]


class Instance(ABC):
    @abstractmethod
    def execute(self, reqs: list[InferRequest]) -> list[Outputs | Exception]:
        """One result per request: its outputs, or the exception that failed it."""

    def finalize(self) -> None:  # noqa: B027 (optional hook: most backends have nothing to release)
        return None


def _model_file(version_dir: Path, cfg: TritonModelConfig, default: str) -> Path:
    path = version_dir / (cfg.raw.get("default_model_filename") or default)
    if not path.exists():
        raise ModelError(f"{cfg.name}: {path} not found")
    return path


class PythonInstance(Instance):
    def __init__(self, cfg: TritonModelConfig, version_dir: Path, index: int, module: Any) -> None:
        self.cfg = cfg
        self.model = module.TritonPythonModel()
        args = {
            "model_config": json.dumps(cfg.to_json()),
            "model_instance_kind": "CPU",
            "model_instance_name": f"{cfg.name}_{index}",
            "model_instance_device_id": "0",
            "model_repository": str(version_dir.parent),
            "model_version": version_dir.name,
            "model_name": cfg.name,
        }
        self._loop: asyncio.AbstractEventLoop | None = None  # for an async execute(): see _await
        if hasattr(self.model, "initialize"):
            self.model.initialize(args)

    def _await(self, coro: Any) -> Any:
        """An async execute() runs on a loop that lives as long as the instance (Triton's python
        backend keeps one), so tasks it starts (a decoupled model answering later) go on after it
        returns."""
        if self._loop is None:
            self._loop = asyncio.new_event_loop()
            name = f"model-{self.cfg.name}-async"
            threading.Thread(target=self._loop.run_forever, name=name, daemon=True).start()
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result()

    @staticmethod
    def load_module(cfg: TritonModelConfig, version_dir: Path) -> Any:
        from tokenmill.triton import pb_utils

        sys.modules.setdefault("triton_python_backend_utils", pb_utils)
        path = _model_file(version_dir, cfg, "model.py")
        name = f"tokenmill_triton_model_{cfg.name}_{version_dir.name}_{id(cfg)}"
        spec = importlib.util.spec_from_file_location(name, path)
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        if not hasattr(module, "TritonPythonModel"):
            raise ModelError(f"{path} defines no TritonPythonModel class")
        return module

    def execute(self, reqs: list[InferRequest]) -> list[Outputs | Exception]:
        from tokenmill.triton import pb_utils

        pb_reqs = []
        collected: list[list[StreamItem]] = []  # default-mode responses sent through the sender
        for r in reqs:
            pb = pb_utils.InferenceRequest(
                model_name=self.cfg.name,
                inputs=[pb_utils.Tensor(n, a) for n, a in r.inputs.items()],
                requested_output_names=r.requested_outputs or [o.name for o in self.cfg.outputs],
                request_id=r.request_id,
                correlation_id=r.correlation_id,
                flags=r.flags,
                parameters=r.parameters,
            )
            if self.cfg.decoupled:
                if r.stream is None:
                    raise ModelError(
                        f"{self.cfg.name}: a decoupled model's request reached it without a stream"
                    )
                stream = r.stream
                pb._sender = pb_utils.InferenceResponseSender(stream.send, lambda s=stream: s.cancelled)
            else:
                box: list[StreamItem] = []
                collected.append(box)
                pb._sender = pb_utils.InferenceResponseSender(box.append, lambda: False)
            pb_reqs.append(pb)
        result = self.model.execute(pb_reqs)
        if inspect.iscoroutine(result):
            result = self._await(result)
        if self.cfg.decoupled:
            if result is not None:
                raise ModelError(f"{self.cfg.name}: a decoupled model's execute() must return None")
            return [{} for _ in reqs]  # the responses travel through each request's stream
        if result is None:  # a default-mode model may answer through the sender too (Triton 24.06+)
            return [self._one_response(box) for box in collected]
        if not isinstance(result, list) or len(result) != len(reqs):
            n = len(result) if isinstance(result, list) else type(result).__name__
            raise ModelError(f"{self.cfg.name}: execute() returned {n} responses for {len(reqs)} requests")
        out: list[Outputs | Exception] = []
        for resp in result:
            if resp.has_error():
                out.append(resp.error())
            else:
                out.append({t.name(): t.as_numpy() for t in resp.output_tensors()})
        return out

    def _one_response(self, box: list[StreamItem]) -> Outputs | Exception:
        answers = [i for i in box if i.outputs is not None or i.error is not None]
        if len(answers) != 1 or not any(i.final for i in box):
            return ModelError(
                f"{self.cfg.name}: a model that is not decoupled must send exactly one response and the "
                f"FINAL flag (it sent {len(answers)} responses)"
            )
        item = answers[0]
        return ModelError(item.error) if item.error is not None else dict(item.outputs or {})

    def finalize(self) -> None:
        if hasattr(self.model, "finalize"):
            self.model.finalize()
        if self._loop is not None:
            self._loop.call_soon_threadsafe(self._loop.stop)


class _BatchingInstance(Instance, ABC):
    """Runs a batch as one call: inputs concatenated along the batch dimension (batched models)."""

    def __init__(self, cfg: TritonModelConfig) -> None:
        self.cfg = cfg

    @abstractmethod
    def run(self, inputs: dict[str, np.ndarray], outputs: list[str]) -> Outputs:
        """The named outputs for one (possibly merged) batch of inputs."""

    def execute(self, reqs: list[InferRequest]) -> list[Outputs | Exception]:
        names = [o.name for o in self.cfg.outputs]
        if not self.cfg.batched:
            return [self.run(r.inputs, names) for r in reqs]
        sizes = [r.batch_size(self.cfg) for r in reqs]
        merged = {n: np.concatenate([r.inputs[n] for r in reqs]) for n in reqs[0].inputs}
        out = self.run(merged, names)
        bounds = np.cumsum([0, *sizes])
        return [{n: a[bounds[i] : bounds[i + 1]] for n, a in out.items()} for i in range(len(reqs))]


class OnnxInstance(_BatchingInstance):
    def __init__(self, cfg: TritonModelConfig, version_dir: Path, index: int) -> None:
        super().__init__(cfg)
        # A MissingExtra is an ImportError: the repository reports it as this model's load error.
        require("triton", f"{cfg.name}: the onnxruntime backend")
        import onnxruntime as ort

        opts = ort.SessionOptions()
        # One thread per instance: instances are the unit of concurrency (instance_group.count).
        opts.intra_op_num_threads = int(cfg.parameters.get("intra_op_thread_count", "1"))
        opts.inter_op_num_threads = 1
        path = _model_file(version_dir, cfg, "model.onnx")
        try:
            self.session = ort.InferenceSession(str(path), opts, providers=["CPUExecutionProvider"])
        except Exception as e:  # onnxruntime raises its own exception types
            raise ModelError(f"{cfg.name}: cannot load {path}: {e}") from None
        have = {i.name for i in self.session.get_inputs()}
        missing = [t.name for t in cfg.inputs if t.name not in have]
        if missing:
            raise ModelError(
                f"{cfg.name}: model.onnx has no input named {', '.join(missing)} (it has {sorted(have)})"
            )

    def run(self, inputs: dict[str, np.ndarray], outputs: list[str]) -> Outputs:
        res = self.session.run(outputs, inputs)
        return dict(zip(outputs, res, strict=True))


class TorchInstance(_BatchingInstance):
    """TorchScript (model.pt) or torch.export (model.pt2); inputs in config order, outputs likewise."""

    def __init__(self, cfg: TritonModelConfig, version_dir: Path, index: int) -> None:
        super().__init__(cfg)
        import torch

        path = _model_file(version_dir, cfg, "model.pt")
        try:
            if path.suffix == ".pt2":
                self.module = torch.export.load(str(path)).module()
            else:
                self.module = torch.jit.load(str(path), map_location="cpu").eval()
        except Exception as e:  # torch raises a variety of types for a bad file
            raise ModelError(f"{cfg.name}: cannot load {path}: {e}") from None

    def run(self, inputs: dict[str, np.ndarray], outputs: list[str]) -> Outputs:
        import torch

        args = [
            torch.from_numpy(np.ascontiguousarray(inputs[t.name]))
            for t in self.cfg.inputs
            if t.name in inputs
        ]
        with torch.inference_mode():
            res = self.module(*args)
        if isinstance(res, dict):
            return {n: res[n].numpy() for n in outputs}
        if isinstance(res, torch.Tensor):
            res = (res,)
        return {n: t.numpy() for n, t in zip(outputs, res, strict=False)}


def create_instances(cfg: TritonModelConfig, version_dir: Path) -> list[Instance]:
    if cfg.backend == "python":
        module = PythonInstance.load_module(cfg, version_dir)
        return [PythonInstance(cfg, version_dir, i, module) for i in range(cfg.instance_count)]
    if cfg.backend == "fil":
        from tokenmill.triton.fil import FilInstance

        return [FilInstance(cfg, version_dir, i) for i in range(cfg.instance_count)]
    cls = {"onnxruntime": OnnxInstance, "pytorch": TorchInstance}[cfg.backend]
    return [cls(cfg, version_dir, i) for i in range(cfg.instance_count)]
