"""The offline API in the shape vLLM users know: `LLM(model=...).generate(prompts, params)`."""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import typing
from collections.abc import Coroutine, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

from rich.progress import Progress

from tokenmill.config import EngineConfig
from tokenmill.engine.client import RequestRejectedError
from tokenmill.engine.engine_core import EngineCore
from tokenmill.engine.inproc_client import InprocEngineClient
from tokenmill.frontend.async_llm import AsyncLLM, Submitted
from tokenmill.lora.adapter import fingerprint, inspect_adapter
from tokenmill.lora.request import LoRARequest
from tokenmill.outputs import EmbeddingOutput, EmbeddingRequestOutput, RequestOutput
from tokenmill.pooling import finish, model_pooling
from tokenmill.sampling_params import SamplingParams

Prompt = str | list[int]
T = TypeVar("T")


class LLM:
    """An engine in this process. Keyword arguments: fields of EngineConfig, SchedulerConfig, CacheConfig,
    ParallelConfig.

    It drives the engine through the same frontend (AsyncLLM: n fan-out, stop strings, incremental
    detokenization, abort) that the server uses, over the in-process EngineClient, on an event loop of
    its own; no thread or process is added.
    """

    def __init__(self, model: str | None = None, **kwargs: Any) -> None:
        self.config = build_engine_config(model, **kwargs)
        self.engine = EngineCore(self.config)
        self.tokenizer = self.engine.tokenizer
        self.client = InprocEngineClient(self.engine)
        self.frontend = AsyncLLM(self.client, self.tokenizer)
        self._loop = asyncio.new_event_loop()
        self._ids = itertools.count()
        self._loras: dict[int, LoRARequest] = {}  # adapters checked, by id

    def run_sync(self, coro: Coroutine[Any, Any, T]) -> T:
        """Run a coroutine on this LLM's event loop (from a thread that runs none: e.g. inside Jupyter's,
        it runs on a helper thread)."""
        try:
            asyncio.get_running_loop()
        except RuntimeError:
            return self._loop.run_until_complete(self._with_client(coro))
        with ThreadPoolExecutor(1) as pool:
            return pool.submit(self._loop.run_until_complete, self._with_client(coro)).result()

    async def _with_client(self, coro: Coroutine[Any, Any, T]) -> T:
        await self.client.start()
        try:
            return await coro
        finally:
            await self.client.stop_loop()  # no task left pending on a loop that sits idle

    def next_request_id(self) -> str:
        return str(next(self._ids))

    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        priority: Sequence[int] | None = None,
        cache_salt: str | None = None,
        use_tqdm: bool = False,
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
    ) -> list[RequestOutput]:
        """Generate for each prompt (text or token ids); outputs come back in prompt order. `lora_request`:
        the adapter of every prompt, or one per prompt (None: the base model); needs enable_lora."""
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
        loras = (
            list(lora_request) if isinstance(lora_request, list | tuple) else [lora_request] * len(prompts)
        )
        if len(loras) != len(prompts):
            raise ValueError(f"{len(prompts)} prompts but {len(loras)} LoRA requests")
        loras = [self._check_lora(x) if x is not None else None for x in loras]
        return self.run_sync(self._generate(prompts, params, priority, cache_salt, use_tqdm, loras))

    def _check_lora(self, lora: LoRARequest) -> LoRARequest:
        """The adapter checked against the model, with its weights' fingerprint (checked once per id;
        an id names one adapter)."""
        checked = self._loras.get(lora.lora_int_id)
        if checked is not None:
            if (checked.lora_name, checked.lora_path) != (lora.lora_name, lora.lora_path):
                raise ValueError(f"lora_int_id {lora.lora_int_id} names another adapter already")
            return checked
        if not self.config.lora.enable_lora:
            raise ValueError("a LoRA request needs LLM(..., enable_lora=True)")
        inspect_adapter(lora.lora_path, self.engine.model_config, self.config.lora.max_lora_rank)
        checked = self._loras[lora.lora_int_id] = dataclasses.replace(
            lora, fingerprint=fingerprint(lora.lora_path)
        )
        return checked

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

    def embed(
        self,
        prompts: Prompt | Sequence[Prompt],
        *,
        pooling: str | None = None,
        normalize: bool | None = None,
        dimensions: int | None = None,
        use_tqdm: bool = False,
    ) -> list[EmbeddingRequestOutput]:
        """An embedding of each prompt (text or token ids): the model's final hidden states pooled as
        its folder says (pooling.py; by default the last token's, normalized), computed by the same
        scheduler as generation (the prompt is read, nothing is sampled)."""
        default = model_pooling(self.config.model)
        params = SamplingParams(max_tokens=1, pooling=pooling or default.type)
        unit = default.normalize if normalize is None else normalize
        outs = self.generate(prompts, params, use_tqdm=use_tqdm)
        return [
            EmbeddingRequestOutput(
                o.request_id,
                o.prompt_token_ids,
                EmbeddingOutput(finish(o.outputs[0].embedding or [], unit, dimensions)),
            )
            for o in outs
        ]

    async def _generate(
        self,
        prompts: list[Prompt],
        params: list[SamplingParams],
        priority: Sequence[int] | None,
        cache_salt: str | None,
        use_tqdm: bool,
        loras: list[LoRARequest | None],
    ) -> list[RequestOutput]:
        # One batch, submitted whole before the engine takes a step (a refused prompt refuses all of
        # it), consumed as one stream of final outputs: no per-request task or per-step copies.
        sub: Submitted | None = None
        order: list[str] = []
        try:
            for i, (prompt, p) in enumerate(zip(prompts, params, strict=True)):
                text = prompt if isinstance(prompt, str) else None
                ids = self.tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)
                prio = priority[i] if priority else 0
                order.append(self.next_request_id())
                sub = self.frontend.submit(order[-1], ids, p, text, prio, cache_salt, into=sub, lora=loras[i])
        except RequestRejectedError as e:
            raise ValueError(str(e)) from None  # submit aborted what the batch had added
        if sub is None:
            return []
        finished: dict[str, RequestOutput] = {}
        with Progress(disable=not use_tqdm, transient=True) as bar:
            task = bar.add_task("generating", total=len(order))
            async for ro in self.frontend.stream(sub, errors_as_outputs=True, final_only=True):
                finished[ro.request_id] = ro
                bar.advance(task)
        return [finished[r] for r in order]

    def close(self) -> None:
        """Stop the engine (and its rank processes, if any)."""
        if not self._loop.is_closed():
            self._loop.run_until_complete(self.client.stop_loop())
            self._loop.close()
        self.engine.shutdown()


def build_engine_config(model: str | None = None, **kwargs: Any) -> EngineConfig:
    """Sort flat keyword arguments into the engine config and its sections. `speculative_config` (a
    mapping, as in vLLM) sets the speculative section whole, e.g. {"method": "ngram"}."""
    hints = typing.get_type_hints(EngineConfig)
    section_cls = {
        f.name: hints[f.name]
        for f in dataclasses.fields(EngineConfig)
        if dataclasses.is_dataclass(hints[f.name])
    }
    top: dict[str, Any] = {}
    nested: dict[str, dict[str, Any]] = {name: {} for name in section_cls}
    spec = kwargs.pop("speculative_config", None)
    if spec is not None:
        nested["speculative"] = dict(spec)
    for key, value in kwargs.items():
        if key in EngineConfig.__dataclass_fields__ and key not in section_cls:
            top[key] = value
            continue
        for name, cls in section_cls.items():
            if key in cls.__dataclass_fields__ and key != "method":
                nested[name][key] = value
                break
        else:
            raise TypeError(f"unknown engine option {key!r}")
    if model is not None:
        top["model"] = model
    return EngineConfig(**top, **{name: cls(**nested[name]) for name, cls in section_cls.items()})
