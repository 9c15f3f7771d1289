"""The offline API in the shape vLLM users know: `LLM(model=...).generate(prompts, params)`."""

from __future__ import annotations

import itertools
import time
from collections.abc import Sequence
from typing import Any

from rich.progress import Progress

from tokenmill.config import CacheConfig, EngineConfig, ParallelConfig, SchedulerConfig
from tokenmill.engine.engine_core import EngineCore
from tokenmill.engine.request import EngineRequest, FinishReason
from tokenmill.frontend.output_processor import OutputProcessor
from tokenmill.outputs import RequestOutput
from tokenmill.sampling_params import SamplingParams

Prompt = str | list[int]


class LLM:
    """An engine in this process. Keyword arguments: fields of EngineConfig, SchedulerConfig, CacheConfig."""

    def __init__(self, model: str | None = None, **kwargs: Any) -> None:
        self.config = build_engine_config(model, **kwargs)
        self.engine = EngineCore(self.config)
        self.tokenizer = self.engine.tokenizer
        self._ids = itertools.count()

    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        priority: Sequence[int] | None = None,
        cache_salt: str | None = None,
        use_tqdm: bool = False,
    ) -> list[RequestOutput]:
        """Generate for each prompt (text or token ids); outputs come back in prompt order."""
        if isinstance(prompts, str) or (
            isinstance(prompts, list) and prompts and isinstance(prompts[0], int)
        ):
            prompts = [prompts]  # type: ignore[list-item]
        prompts = list(prompts)  # type: ignore[arg-type]
        if sampling_params is None:
            sampling_params = SamplingParams()
        params = (
            [sampling_params] * len(prompts)
            if isinstance(sampling_params, SamplingParams)
            else list(sampling_params)
        )
        if len(params) != len(prompts):
            raise ValueError(f"{len(prompts)} prompts but {len(params)} sampling params")
        if priority is not None and len(priority) != len(prompts):
            raise ValueError(f"{len(prompts)} prompts but {len(priority)} priorities")
        return self._run(prompts, params, priority, cache_salt, use_tqdm)

    def chat(
        self,
        messages: list[dict[str, Any]] | list[list[dict[str, Any]]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        add_generation_prompt: bool = True,
        **kwargs: Any,
    ) -> list[RequestOutput]:
        """Apply the model's chat template to one conversation (or a list of them), then generate."""
        convs = [messages] if messages and isinstance(messages[0], dict) else messages
        prompts: list[Prompt] = [
            self.tokenizer.encode_chat(c, add_generation_prompt=add_generation_prompt)  # type: ignore[arg-type]
            for c in convs
        ]
        return self.generate(prompts, sampling_params, **kwargs)

    def step(self, proc: OutputProcessor) -> list[RequestOutput]:
        """One engine step, its outputs through the frontend; sequences a stop string ended are finished."""
        outs, stopped = proc.process(self.engine.step())
        if stopped:
            self.engine.finish(stopped, FinishReason.STOP)
        return outs

    def _run(
        self,
        prompts: list[Prompt],
        params: list[SamplingParams],
        priority: Sequence[int] | None,
        cache_salt: str | None,
        use_tqdm: bool,
    ) -> list[RequestOutput]:
        proc = OutputProcessor(self.tokenizer)
        order: list[str] = []
        eos = frozenset(self.tokenizer.eos_token_ids)
        added: list[str] = []
        try:
            for i, (prompt, p) in enumerate(zip(prompts, params, strict=True)):
                text = prompt if isinstance(prompt, str) else None
                ids = self.tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)
                rid = str(next(self._ids))
                arrival = time.monotonic()
                for cid, cp in proc.add_request(rid, text, ids, p, arrival):
                    prio = priority[i] if priority else 0
                    self.engine.add_request(EngineRequest(cid, ids, cp, eos, arrival, prio, cache_salt))
                    added.append(cid)
                order.append(rid)
        except Exception:
            self.engine.abort(added)  # all or nothing: no half-submitted batch stays in the engine
            raise

        finished: dict[str, RequestOutput] = {}
        with Progress(disable=not use_tqdm, transient=True) as bar:
            task = bar.add_task("generating", total=len(order))
            while self.engine.has_unfinished():
                for ro in self.step(proc):
                    if ro.finished:
                        finished[ro.request_id] = ro
                        bar.advance(task)
        return [finished[r] for r in order]


def build_engine_config(model: str | None = None, **kwargs: Any) -> EngineConfig:
    """Sort flat keyword arguments into the engine, scheduler and cache configs."""
    groups: dict[type, dict[str, Any]] = {
        EngineConfig: {},
        SchedulerConfig: {},
        CacheConfig: {},
        ParallelConfig: {},
    }
    for key, value in kwargs.items():
        for cls, bucket in groups.items():
            if key in cls.__dataclass_fields__ and key not in ("scheduler", "cache", "parallel"):
                bucket[key] = value
                break
        else:
            raise TypeError(f"unknown engine option {key!r}")
    if model is not None:
        groups[EngineConfig]["model"] = model
    return EngineConfig(
        **groups[EngineConfig],
        scheduler=SchedulerConfig(**groups[SchedulerConfig]),
        cache=CacheConfig(**groups[CacheConfig]),
        parallel=ParallelConfig(**groups[ParallelConfig]),
    )
