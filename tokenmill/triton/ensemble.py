"""Ensembles: a pipeline of models run as one request, each step as soon as its inputs exist.

Tensors live in an ensemble-scoped namespace: the ensemble's inputs, then every step's outputs under
the names its output_map gives them. A step starts once every tensor its input_map names is there;
steps without a dependency between them run at the same time.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable

from tokenmill.triton.backends import InferRequest, Outputs
from tokenmill.triton.config import TritonModelConfig
from tokenmill.triton.scheduling import InferError

# (model name, version or -1, request) -> outputs: the repository's infer.
InferFn = Callable[[str, int, InferRequest], Awaitable[Outputs]]


def check_graph(cfg: TritonModelConfig) -> None:
    """Every step input must come from the ensemble's inputs or an earlier step's output."""
    have = {t.name for t in cfg.inputs}
    produced = {v for s in cfg.ensemble_steps for v in (m["value"] for m in s.get("output_map", []))}
    for s in cfg.ensemble_steps:
        for m in s.get("input_map", []):
            if m["value"] not in have | produced:
                raise ValueError(
                    f"ensemble {cfg.name!r}: step {s['model_name']!r} reads {m['value']!r}, "
                    "which no input or step provides"
                )
    for t in cfg.outputs:
        if t.name not in produced:
            raise ValueError(f"ensemble {cfg.name!r}: output {t.name!r} is produced by no step")


async def run_ensemble(cfg: TritonModelConfig, req: InferRequest, infer: InferFn) -> Outputs:
    tensors = dict(req.inputs)
    pending = list(range(len(cfg.ensemble_steps)))
    running: dict[asyncio.Task, tuple[int, InferRequest]] = {}
    try:
        while pending or running:
            for i in list(pending):
                step = cfg.ensemble_steps[i]
                needs = {m["key"]: m["value"] for m in step.get("input_map", [])}
                if all(v in tensors for v in needs.values()):
                    sub = InferRequest(
                        {k: tensors[v] for k, v in needs.items()},
                        requested_outputs=[m["key"] for m in step.get("output_map", [])] or None,
                        parameters=req.parameters,
                        request_id=req.request_id,
                    )
                    task = asyncio.ensure_future(
                        infer(step["model_name"], step.get("model_version", -1), sub)
                    )
                    running[task] = (i, sub)
                    pending.remove(i)
            if not running:
                missing = [cfg.ensemble_steps[i]["model_name"] for i in pending]
                raise InferError(400, f"ensemble {cfg.name!r}: steps {missing} never got their inputs")
            done, _ = await asyncio.wait(running, return_when=asyncio.FIRST_COMPLETED)
            for task in done:
                i, sub = running.pop(task)
                step = cfg.ensemble_steps[i]
                out = task.result()  # re-raises the step's InferError
                req.times.add(sub.times)
                for m in step.get("output_map", []):
                    if m["key"] not in out:
                        raise InferError(500, f"step {step['model_name']!r} did not return {m['key']!r}")
                    tensors[m["value"]] = out[m["key"]]
    finally:
        for task in running:
            task.cancel()
    return {t.name: tensors[t.name] for t in cfg.outputs}
