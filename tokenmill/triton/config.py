"""A model's config.pbtxt: the fields tokenmill implements, checked line by line.

Fields Triton has and tokenmill does not implement (optimization, implicit sequence state, ...) are
rejected with their line, rather than silently ignored.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tokenmill.triton.dtypes import CONFIG_TO_PROTOCOL
from tokenmill.triton.pbtxt import ConfigError, Schema, decode, parse

DATA_TYPES = ("enum", set(CONFIG_TO_PROTOCOL) | {"TYPE_BF16"})
QUEUE_POLICY: Schema = {
    "timeout_action": (("enum", {"REJECT", "DELAY"}), False),
    "default_timeout_microseconds": ("int", False),
    "allow_timeout_override": ("bool", False),
    "max_queue_size": ("int", False),
}
TENSOR: Schema = {
    "name": ("string", False),
    "data_type": (DATA_TYPES, False),
    "dims": ("int", True),
    "reshape": ({"shape": ("int", True)}, False),
    "optional": ("bool", False),
    "label_filename": ("string", False),
    "format": (("enum", {"FORMAT_NONE"}), False),
    "is_shape_tensor": ("unsupported", False),
    "allow_ragged_batch": ("bool", False),  # (tensorrtllm only: its requests are never concatenated)
}
CONTROL: Schema = {
    "kind": (
        (
            "enum",
            {
                "CONTROL_SEQUENCE_START",
                "CONTROL_SEQUENCE_READY",
                "CONTROL_SEQUENCE_END",
                "CONTROL_SEQUENCE_CORRID",
            },
        ),
        False,
    ),
    "int32_false_true": ("int", True),
    "fp32_false_true": ("float", True),
    "bool_false_true": ("bool", True),
    "data_type": (DATA_TYPES, False),
}
WARMUP_INPUT: Schema = {
    "data_type": (DATA_TYPES, False),
    "dims": ("int", True),
    "zero_data": ("bool", False),
    "random_data": ("bool", False),
    "input_data_file": ("string", False),
}
WARMUP: Schema = {
    "name": ("string", False),
    "batch_size": ("int", False),
    "count": ("int", False),
    "inputs": ({"key": ("string", False), "value": (WARMUP_INPUT, False)}, True),
}
SCHEMA: Schema = {
    "name": ("string", False),
    "platform": ("string", False),
    "backend": ("string", False),
    "runtime": ("string", False),
    "max_batch_size": ("int", False),
    "default_model_filename": ("string", False),
    "version_policy": (
        {
            "latest": ({"num_versions": ("int", False)}, False),
            "all": ({}, False),
            "specific": ({"versions": ("int", True)}, False),
        },
        False,
    ),
    "input": (TENSOR, True),
    "output": (TENSOR, True),
    "dynamic_batching": (
        {
            "preferred_batch_size": ("int", True),
            "max_queue_delay_microseconds": ("int", False),
            "preserve_ordering": ("bool", False),
            "priority_levels": ("int", False),
            "default_priority_level": ("int", False),
            "default_queue_policy": (QUEUE_POLICY, False),
            "priority_queue_policy": ({"key": ("int", False), "value": (QUEUE_POLICY, False)}, True),
        },
        False,
    ),
    "sequence_batching": (
        {
            "max_sequence_idle_microseconds": ("int", False),
            "direct": (
                {
                    "max_queue_delay_microseconds": ("int", False),
                    "minimum_slot_utilization": ("float", False),
                },
                False,
            ),
            "oldest": (
                {
                    "max_candidate_sequences": ("int", False),
                    "preferred_batch_size": ("int", True),
                    "max_queue_delay_microseconds": ("int", False),
                    "preserve_ordering": ("bool", False),
                },
                False,
            ),
            "control_input": ({"name": ("string", False), "control": (CONTROL, True)}, True),
            "state": ("unsupported", True),
            "iterative_sequence": ("unsupported", False),
        },
        False,
    ),
    "ensemble_scheduling": (
        {
            "step": (
                {
                    "model_name": ("string", False),
                    "model_version": ("int", False),
                    "input_map": ({"key": ("string", False), "value": ("string", False)}, True),
                    "output_map": ({"key": ("string", False), "value": ("string", False)}, True),
                },
                True,
            ),
            "max_inflight_requests": ("int", False),
        },
        False,
    ),
    "instance_group": (
        {
            "name": ("string", False),
            "count": ("int", False),
            "kind": (("enum", {"KIND_AUTO", "KIND_GPU", "KIND_CPU", "KIND_MODEL"}), False),
            "gpus": ("int", True),
            "rate_limiter": ("unsupported", False),
            "passive": ("unsupported", False),
        },
        True,
    ),
    "parameters": ({"key": ("string", False), "value": ({"string_value": ("string", False)}, False)}, True),
    "model_transaction_policy": ({"decoupled": ("bool", False)}, False),
    "optimization": ("unsupported", False),
    "model_warmup": (WARMUP, True),
    "response_cache": ({"enable": ("bool", False)}, False),
    "batch_input": ("unsupported", True),
    "batch_output": ("unsupported", True),
    "model_repository_agents": ("unsupported", False),
    "model_operations": ("unsupported", False),
    "metric_tags": ("unsupported", False),
    "cc_model_filenames": ("unsupported", False),
    "model_metrics": ("unsupported", False),
}

BACKENDS = {
    "python": "python",
    "onnxruntime": "onnxruntime",
    "pytorch": "pytorch",
    "ensemble": "ensemble",
    "fil": "fil",  # tree models (triton/fil.py)
    "tensorrtllm": "tensorrtllm",  # served by the server's LLM (triton/trtllm_model.py)
}
PLATFORMS = {"onnxruntime_onnx": "onnxruntime", "pytorch_libtorch": "pytorch", "ensemble": "ensemble"}


@dataclass
class TensorSpec:
    name: str
    datatype: str  # protocol name (FP32, BYTES, ...)
    dims: list[int]  # without the batch dimension; -1 = variable
    optional: bool = False

    def metadata(self, batched: bool) -> dict[str, Any]:
        return {"name": self.name, "datatype": self.datatype, "shape": ([-1] if batched else []) + self.dims}


@dataclass
class TritonModelConfig:
    name: str
    backend: str  # python | onnxruntime | pytorch | ensemble
    max_batch_size: int
    inputs: list[TensorSpec]
    outputs: list[TensorSpec]
    raw: dict[str, Any]  # the decoded config, in config.pbtxt's field names
    platform: str = ""
    instance_count: int = 1
    dynamic_batching: dict[str, Any] | None = None
    sequence_batching: dict[str, Any] | None = None
    ensemble_steps: list[dict[str, Any]] = field(default_factory=list)
    parameters: dict[str, str] = field(default_factory=dict)
    decoupled: bool = False  # model_transaction_policy { decoupled: true }: 0..n responses per request
    response_cache: bool = False  # response_cache { enable: true }
    warmup: list[dict[str, Any]] = field(default_factory=list)  # model_warmup samples, as decoded

    @property
    def batched(self) -> bool:
        return self.max_batch_size > 0

    def input(self, name: str) -> TensorSpec | None:
        return next((t for t in self.inputs if t.name == name), None)

    def to_json(self) -> dict[str, Any]:
        """The configuration as Triton's JSON (the model_configuration extension, and what a Python
        model's initialize() gets): proto field names, and protobuf maps as objects."""
        import copy

        d = copy.deepcopy(self.raw)
        if "parameters" in d:
            d["parameters"] = {p["key"]: p.get("value", {}) for p in d["parameters"]}
        dyn = d.get("dynamic_batching", {})
        if "priority_queue_policy" in dyn:
            dyn["priority_queue_policy"] = {
                str(p["key"]): p.get("value", {}) for p in dyn["priority_queue_policy"]
            }
        for step in d.get("ensemble_scheduling", {}).get("step", []):
            # Written out when the file leaves it out: -1 (the latest) is what runs, and perf_analyzer
            # reads every step's model_version.
            step.setdefault("model_version", -1)
            for key in ("input_map", "output_map"):
                step[key] = {m["key"]: m["value"] for m in step.get(key, [])}
        d["name"], d["backend"], d["max_batch_size"] = self.name, self.backend, self.max_batch_size
        if self.platform:
            d["platform"] = self.platform
        d["instance_group"] = d.get("instance_group") or [{"count": self.instance_count, "kind": "KIND_CPU"}]
        return d


def load_config(model_dir: Path) -> TritonModelConfig:
    path = model_dir / "config.pbtxt"
    source = str(path)
    if not path.is_file():
        raise ConfigError(f"{model_dir}: no config.pbtxt")
    raw = decode(parse(path.read_text(encoding="utf-8"), source), SCHEMA, source)
    name = raw.get("name", model_dir.name)
    if name != model_dir.name:
        raise ConfigError(f"{source}: name {name!r} differs from the directory name {model_dir.name!r}")
    platform = raw.get("platform", "")
    backend = raw.get("backend") or PLATFORMS.get(platform, "")
    if backend not in BACKENDS:
        what = f"backend {raw['backend']!r}" if raw.get("backend") else f"platform {platform!r}"
        raise ConfigError(f"{source}: {what} is not supported ({', '.join(BACKENDS)})")
    if raw.get("model_transaction_policy", {}).get("decoupled") and backend not in (
        "python",
        "ensemble",
        "tensorrtllm",
    ):
        # Only a model's own code can send 0..n responses; a tensor backend answers each request once.
        raise ConfigError(f"{source}: decoupled models need the python backend (this one is {backend})")
    kinds = [k for k in ("dynamic_batching", "sequence_batching", "ensemble_scheduling") if k in raw]
    if len(kinds) > 1:
        raise ConfigError(f"{source}: {' and '.join(kinds)} are mutually exclusive")
    if backend == "ensemble" and "ensemble_scheduling" not in raw:
        raise ConfigError(f"{source}: an ensemble needs ensemble_scheduling")

    def tensors(key: str) -> list[TensorSpec]:
        out = []
        for t in raw.get(key, []):
            if "name" not in t or "data_type" not in t:
                raise ConfigError(f"{source}: every {key} needs a name and a data_type")
            if t.get("allow_ragged_batch") and backend != "tensorrtllm":
                raise ConfigError(f"{source}: {key} {t['name']!r}: allow_ragged_batch is not supported")
            if t["data_type"] == "TYPE_BF16":
                raise ConfigError(f"{source}: {key} {t['name']!r}: TYPE_BF16 tensors are not supported")
            out.append(
                TensorSpec(
                    t["name"],
                    CONFIG_TO_PROTOCOL[t["data_type"]],
                    list(t.get("dims", [])),
                    t.get("optional", False),
                )
            )
        return out

    count = sum(g.get("count", 1) for g in raw.get("instance_group", [])) or 1
    dyn = raw.get("dynamic_batching")
    if dyn is not None and raw.get("max_batch_size", 0) <= 0:
        raise ConfigError(f"{source}: dynamic_batching needs max_batch_size > 0")
    if dyn is not None and any(p > raw["max_batch_size"] for p in dyn.get("preferred_batch_size", [])):
        raise ConfigError(f"{source}: a preferred_batch_size is larger than max_batch_size")
    return TritonModelConfig(
        name=name,
        backend=backend,
        max_batch_size=raw.get("max_batch_size", 0),
        inputs=tensors("input"),
        outputs=tensors("output"),
        raw=raw,
        platform=platform,
        instance_count=count,
        dynamic_batching=dyn,
        sequence_batching=raw.get("sequence_batching"),
        ensemble_steps=raw.get("ensemble_scheduling", {}).get("step", []),
        parameters={p["key"]: p.get("value", {}).get("string_value", "") for p in raw.get("parameters", [])},
        decoupled=bool(raw.get("model_transaction_policy", {}).get("decoupled", False)),
        response_cache=bool(raw.get("response_cache", {}).get("enable", False)),
        warmup=list(raw.get("model_warmup", [])),
    )
