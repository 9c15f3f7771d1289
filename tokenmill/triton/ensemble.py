"""Ensembles: a pipeline of models run as one request, each step as soon as its inputs exist.

Tensors live in an ensemble-scoped namespace: the ensemble's inputs, then every step's outputs under
the names its output_map gives them. A step starts once every tensor its input_map names is there;
steps without a dependency between them run at the same time.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Awaitable, Callable

from tokenmill.triton.backends import InferRequest, Outputs
from tokenmill.triton.config import TritonModelConfig
from tokenmill.triton.decoupled import StreamItem
from tokenmill.triton.scheduling import InferError

# (model name, version or -1, request) -> outputs: the repository's infer.
InferFn = Callable[[str, int, InferRequest], Awaitable[Outputs]]
# The same, as the responses come: the repository's infer_stream.
StreamFn = Callable[[str, int, InferRequest], AsyncIterator[StreamItem]]


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
    steps = set(range(len(cfg.ensemble_steps)))
    tensors = await _run_steps(cfg, req, infer, dict(req.inputs), steps)
    return {t.name: tensors[t.name] for t in cfg.outputs}


def _downstream(cfg: TritonModelConfig, first: int) -> set[int]:
    """The steps that read, directly or not, what step `first` produces (`first` not included)."""
    made = {m["value"] for m in cfg.ensemble_steps[first].get("output_map", [])}
    found: set[int] = set()
    grew = True
    while grew:
        grew = False
        for i, s in enumerate(cfg.ensemble_steps):
            if i == first or i in found:
                continue
            if {m["value"] for m in s.get("input_map", [])} & made:
                found.add(i)
                made |= {m["value"] for m in s.get("output_map", [])}
                grew = True
    return found


async def stream_ensemble(
    cfg: TritonModelConfig,
    req: InferRequest,
    infer: InferFn,
    infer_stream: StreamFn,
    decoupled: int,
) -> AsyncIterator[StreamItem]:
    """An ensemble with one decoupled step (`decoupled`, its index), as Triton runs one: the steps it
    does not feed run once; every response of the decoupled step then runs the steps after it and is
    one response of the ensemble (in order; the FINAL flag alone passes through as it is)."""
    after = _downstream(cfg, decoupled)
    before = set(range(len(cfg.ensemble_steps))) - after - {decoupled}
    tensors = await _run_steps(cfg, req, infer, dict(req.inputs), before)
    step = cfg.ensemble_steps[decoupled]
    sub = _step_request(step, tensors, req)
    async with contextlib.aclosing(
        infer_stream(step["model_name"], step.get("model_version", -1), sub)
    ) as items:
        async for item in items:
            if item.error is not None or item.outputs is None:
                yield item
                continue
            now = dict(tensors)
            for m in step.get("output_map", []):
                if m["key"] not in item.outputs:
                    raise InferError(500, f"step {step['model_name']!r} did not return {m['key']!r}")
                now[m["value"]] = item.outputs[m["key"]]
            now = await _run_steps(cfg, req, infer, now, after)
            yield StreamItem({t.name: now[t.name] for t in cfg.outputs if t.name in now}, final=item.final)


def _absent(cfg: TritonModelConfig, req: InferRequest) -> set[str]:
    """The ensemble's optional inputs this request leaves out: the steps reading them run without them
    (as Triton's do: TensorRT-LLM's ensemble passes `temperature`, `stop_words`, ... this way)."""
    return {t.name for t in cfg.inputs if t.optional and t.name not in req.inputs}


def _step_request(step: dict, tensors: dict, req: InferRequest) -> InferRequest:
    needs = {m["key"]: m["value"] for m in step.get("input_map", [])}
    return InferRequest(
        {k: tensors[v] for k, v in needs.items() if v in tensors},
        requested_outputs=[m["key"] for m in step.get("output_map", [])] or None,
        parameters=req.parameters,
        request_id=req.request_id,
    )


async def _run_steps(
    cfg: TritonModelConfig, req: InferRequest, infer: InferFn, tensors: dict, steps: set[int]
) -> dict:
    """Run `steps` of the ensemble, each as soon as its inputs are among `tensors`; the tensors then."""
    pending = sorted(steps)
    absent = _absent(cfg, req)
    running: dict[asyncio.Task, tuple[int, InferRequest]] = {}
    try:
        while pending or running:
            for i in list(pending):
                step = cfg.ensemble_steps[i]
                needs = {m["key"]: m["value"] for m in step.get("input_map", [])}
                if all(v in tensors or v in absent for v in needs.values()):
                    sub = _step_request(step, tensors, req)
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
    return tensors
