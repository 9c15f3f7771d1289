"""The server's LLM as a model of the Triton repository: what TensorRT-LLM's ensemble is on Triton.

It is listed in the repository index under the served model's name, with a config like the TensorRT-LLM
ensemble's (text in, text out, the sampling settings as optional inputs) plus token ids in and out, so
that a repository's own pre- and post-processing models can tokenize and detokenize around it. It is
decoupled: with `stream` true every new piece of text is a response; otherwise one response carries
the whole completion. `generate`, `generate_stream`, gRPC ModelStreamInfer, ensembles and BLS calls
reach it as any other model; the engine batches its requests with the OpenAI API's.
"""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from tokenmill.sampling_params import SamplingParams
from tokenmill.server.errors import APIError
from tokenmill.server.openai_serving import generation_error
from tokenmill.triton.backends import InferRequest, Instance, Outputs
from tokenmill.triton.config import TensorSpec, TritonModelConfig
from tokenmill.triton.decoupled import ResponseStream, StreamItem

BACKEND = "tokenmill"
# (name, datatype, dims): every input is optional; a request needs text_input or input_ids.
INPUTS = [
    ("text_input", "BYTES", [1]),
    ("input_ids", "INT32", [-1]),
    ("max_tokens", "INT32", [1]),
    ("temperature", "FP32", [1]),
    ("top_p", "FP32", [1]),
    ("top_k", "INT32", [1]),
    ("min_tokens", "INT32", [1]),
    ("repetition_penalty", "FP32", [1]),
    ("presence_penalty", "FP32", [1]),
    ("frequency_penalty", "FP32", [1]),
    ("random_seed", "UINT64", [1]),
    ("stop_words", "BYTES", [-1]),
    ("stream", "BOOL", [1]),
]
OUTPUTS = [("text_output", "BYTES", [1]), ("output_ids", "INT32", [-1]), ("finish_reason", "BYTES", [1])]
_SCALARS = {
    "max_tokens": int,
    "temperature": float,
    "top_p": float,
    "top_k": int,
    "min_tokens": int,
    "repetition_penalty": float,
    "presence_penalty": float,
    "frequency_penalty": float,
    "random_seed": int,
}


def llm_config(name: str, max_tokens_default: int) -> TritonModelConfig:
    """The configuration the repository shows for the LLM (its `config` and `model_configuration`)."""

    def spec(t: tuple[str, str, list[int]], optional: bool) -> TensorSpec:
        return TensorSpec(t[0], t[1], list(t[2]), optional)

    def raw_tensor(t: tuple[str, str, list[int]], optional: bool) -> dict[str, Any]:
        d: dict[str, Any] = {"name": t[0], "data_type": "TYPE_STRING" if t[1] == "BYTES" else f"TYPE_{t[1]}"}
        d["dims"] = list(t[2])
        if optional:
            d["optional"] = True
        return d

    raw = {
        "name": name,
        "backend": BACKEND,
        "max_batch_size": 1,
        "input": [raw_tensor(t, True) for t in INPUTS],
        "output": [raw_tensor(t, False) for t in OUTPUTS],
        "model_transaction_policy": {"decoupled": True},
        "parameters": [
            {"key": "max_tokens_default", "value": {"string_value": str(max_tokens_default)}},
        ],
    }
    return TritonModelConfig(
        name=name,
        backend=BACKEND,
        max_batch_size=1,
        inputs=[spec(t, True) for t in INPUTS],
        outputs=[spec(t, False) for t in OUTPUTS],
        raw=raw,
        decoupled=True,
        parameters={"max_tokens_default": str(max_tokens_default)},
    )


class BadRequest(ValueError):
    """The request's own fault: said with a 400."""


@dataclass
class _Ask:
    prompt_ids: list[int]
    prompt: str | None
    params: SamplingParams
    stream: bool


def _flag(v: Any) -> bool:
    """A BOOL input or a generate parameter as sent: true, 1, "true" (not "false" or "0")."""
    return bool(v) and str(v).lower() not in ("false", "0")


def _scalar(req: InferRequest, name: str) -> Any:
    """An input's single value, else the request parameter of that name (generate's extra keys)."""
    a = req.inputs.get(name)
    if a is not None:
        if a.size != 1:
            raise BadRequest(f"{name!r} takes one value, got shape {list(a.shape)}")
        v = a.reshape(-1)[0]
        return v.decode(errors="replace") if isinstance(v, bytes) else v.item() if hasattr(v, "item") else v
    return req.parameters.get(name)


class LLMInstance(Instance):
    """Hands each request to the engine on the server's loop and returns at once: the responses follow
    on the request's stream, so one instance keeps any number of requests in the engine's batch."""

    _ids = itertools.count()

    def __init__(
        self,
        cfg: TritonModelConfig,
        llm: Any,
        loop: asyncio.AbstractEventLoop,
        lora: Callable[[], Any] | None = None,
        admission: Any = None,
    ) -> None:
        """`lora`: for an adapter's model, its LoRARequest as the server's registry has it now (None
        once the adapter is unloaded). `admission`: the server's (server/admission.py)."""
        self.cfg, self.llm, self.loop, self.lora, self.admission = cfg, llm, loop, lora, admission
        self.max_tokens_default = int(cfg.parameters.get("max_tokens_default", "16"))

    def execute(self, reqs: list[InferRequest]) -> list[Outputs | Exception]:
        for r in reqs:
            assert r.stream is not None  # the repository gives every request to a decoupled model one
            asyncio.run_coroutine_threadsafe(self._run(r, r.stream), self.loop)  # _run ends its stream
        return [{} for _ in reqs]

    def _ask(self, req: InferRequest) -> _Ask:
        tok = self.llm.tokenizer
        text = _scalar(req, "text_input")
        ids = req.inputs.get("input_ids")
        if ids is not None:
            prompt_ids = [int(i) for i in ids.reshape(-1)]
            vocab = tok.vocab_size
            if any(i < 0 or i >= vocab for i in prompt_ids):
                raise BadRequest(f"input_ids: every id must be in 0..{vocab - 1}")
            prompt = None
        elif text is not None:
            prompt, prompt_ids = str(text), tok.encode(str(text))
        else:
            raise BadRequest(f"model {self.cfg.name!r} needs text_input or input_ids")
        if not prompt_ids:
            raise BadRequest("the prompt is empty")
        values = {k: _scalar(req, k) for k in _SCALARS}
        try:
            values = {k: conv(v) for k, v in values.items() if v is not None for conv in [_SCALARS[k]]}
        except (TypeError, ValueError, OverflowError) as e:
            raise BadRequest(f"a sampling setting is not a number: {e}") from None
        limit = self.llm.max_model_len
        max_tokens = values.pop("max_tokens", self.max_tokens_default)
        if len(prompt_ids) + max_tokens > limit:
            raise BadRequest(
                f"this model's context is {limit} tokens: the prompt's {len(prompt_ids)} and max_tokens "
                f"{max_tokens} do not fit"
            )
        stops = req.inputs.get("stop_words")
        stop = (
            [s.decode(errors="replace") if isinstance(s, bytes) else str(s) for s in stops.reshape(-1)]
            if (stops is not None)
            else []
        )
        seed = values.pop("random_seed", None)
        stream = _scalar(req, "stream")
        try:
            params = SamplingParams(max_tokens=max_tokens, seed=seed, stop=[s for s in stop if s], **values)
        except (TypeError, ValueError, OverflowError) as e:
            raise BadRequest(str(e)) from None
        return _Ask(prompt_ids, prompt, params, _flag(stream))

    def _asks(self, req: InferRequest) -> list[_Ask]:
        """The sequences a request asks for (a backend that takes batched requests has several)."""
        return [self._ask(req)]

    async def _respond(self, asks: list[_Ask], lora: Any, stream: ResponseStream) -> None:
        await self._generate(asks[0], lora, stream)

    async def _run(self, req: InferRequest, stream: ResponseStream) -> None:
        """Every way out ends the stream: a response with FINAL, or an error with its status."""
        tickets = []
        try:
            asks = self._asks(req)
            lora = None
            if self.lora is not None:
                lora = self.lora()
                if lora is None:
                    raise APIError(404, f"LoRA adapter {self.cfg.name!r} is not served")
            if self.admission is not None:  # the same bounds (and 429s) as the OpenAI API's requests
                for ask in asks:
                    tickets.append(self.admission.admit())
                    self.admission.add_work(tickets[-1], 1, len(ask.prompt_ids))
            await self._respond(asks, lora, stream)
        except BadRequest as e:
            stream.fail(str(e), 400)
        except APIError as e:
            stream.fail(e.message, e.status)
        except Exception as e:  # the engine's (dead, shed, rejected), or a mistake here: said, never a hang
            err = generation_error(e)
            stream.fail(f"model {self.cfg.name!r}: {err.message}", err.status)
        finally:
            for ticket in tickets:
                self.admission.release(ticket)

    async def _generate(self, ask: _Ask, lora: Any, stream: ResponseStream) -> None:
        rid = f"triton-{self.cfg.name}-{next(self._ids)}"
        text, ids = [], []
        # (Not the request's Triton priority: its levels, 1 the highest, are not the engine's.)
        gen = self.llm.generate(rid, ask.prompt_ids, ask.params, prompt=ask.prompt, lora=lora)
        try:
            async for ro in gen:
                if stream.cancelled:  # the reader has gone: closing the generator aborts the request
                    stream.fail("cancelled")
                    return
                o = ro.outputs[0]
                if ask.stream:
                    # The last piece carries the FINAL flag, as TensorRT-LLM sends it.
                    if o.delta_token_ids or o.finish_reason is not None:
                        out = self._outputs(o.delta_text, o.delta_token_ids, o.finish_reason)
                        stream.send(StreamItem(out, final=o.finish_reason is not None))
                else:
                    text.append(o.delta_text)
                    ids.extend(o.delta_token_ids)
                    if o.finish_reason is not None:
                        stream.send(
                            StreamItem(self._outputs("".join(text), ids, o.finish_reason), final=True)
                        )
        finally:
            await gen.aclose()
        stream.fail(f"model {self.cfg.name!r}: the engine ended the request without finishing it")

    @staticmethod
    def _outputs(text: str, ids: list[int], finish: str | None) -> Outputs:
        # With the batch dimension of the model's batch of one.
        return {
            "text_output": np.array([[text.encode()]], dtype=object),
            "output_ids": np.array([ids], dtype=np.int32).reshape(1, len(ids)),
            "finish_reason": np.array([[(finish or "").encode()]], dtype=object),
        }
