"""A repository's `backend: "tensorrtllm"` model, served by the server's LLM.

A Triton + TensorRT-LLM repository (preprocessing -> tensorrt_llm -> postprocessing, an ensemble or a
BLS model around them) runs here unchanged: its `tensorrt_llm` model keeps its config.pbtxt, and the
requests it gets in TensorRT-LLM's tensors are run by the engine tokenmill serves. The engine files
its parameters name (`gpt_model_path`, ...) are not read: the model is the one this server loaded.

TensorRT-LLM's layout, as its backend has it:
- inputs: `input_ids` [batch, len] with `input_lengths`, `request_output_len` (required), `end_id`,
  `pad_id`, `temperature`, `runtime_top_k`, `runtime_top_p`, `repetition_penalty`, `presence_penalty`,
  `frequency_penalty`, `min_tokens` (or the older `min_length`), `random_seed`, `streaming`,
  `stop_words_list` / `bad_words_list` ([batch, 2, n]: the words' ids end to end, then each word's end
  offset, -1 padded), `embedding_bias` [batch, vocab], `return_log_probs`;
- outputs: `output_ids` [batch, beam, len] and `sequence_length` [batch, beam]; the prompt comes first
  unless the parameter `exclude_input_in_output` is true, and streaming responses hold only the new
  tokens. The end token is not part of the output. `cum_log_probs` [batch, beam] and
  `output_log_probs` [batch, beam, len] with `return_log_probs`; `batch_index`.
- a streaming request needs `model_transaction_policy { decoupled: true }`; a request of several
  sequences is not streamed.
"""

from __future__ import annotations

import asyncio
import logging
import math
from dataclasses import dataclass, field
from typing import Any, cast

import numpy as np

from tokenmill.sampling_params import SamplingParams
from tokenmill.triton.backends import InferRequest, Outputs
from tokenmill.triton.config import TritonModelConfig
from tokenmill.triton.decoupled import ResponseStream, StreamItem
from tokenmill.triton.llm_model import BadRequest, LLMInstance, _Ask, _flag

log = logging.getLogger(__name__)

# TensorRT-LLM's input name -> (SamplingParams field, conversion).
SAMPLING = {
    "temperature": ("temperature", float),
    "runtime_top_k": ("top_k", int),
    "runtime_top_p": ("top_p", float),
    "repetition_penalty": ("repetition_penalty", float),
    "presence_penalty": ("presence_penalty", float),
    "frequency_penalty": ("frequency_penalty", float),
    "min_tokens": ("min_tokens", int),
    "min_length": ("min_tokens", int),
    "random_seed": ("seed", int),
}
# Inputs that change nothing here: beam search's length settings, and the GPU executor's own knobs.
IGNORED = {"len_penalty", "length_penalty", "early_stopping", "beam_search_diversity_rate"}
# Inputs asking for what this engine does not do; they are refused when set (not zero, not empty).
UNSUPPORTED = {
    "prompt_embedding_table": "prompt tuning tables",
    "prompt_vocab_size": "prompt tuning tables",
    "lora_task_id": "LoRA by task id (call the adapter's model by its name)",
    "lora_weights": "LoRA weights sent with a request (load the adapter with the server)",
    "lora_config": "LoRA weights sent with a request (load the adapter with the server)",
    "draft_input_ids": "draft tokens sent with a request",
    "draft_logits": "draft tokens sent with a request",
    "encoder_input_features": "encoder-decoder models",
    "encoder_output_lengths": "encoder-decoder models",
    "no_repeat_ngram_size": "no_repeat_ngram_size",
}
KNOWN_INPUTS = (
    {
        "input_ids",
        "input_lengths",
        "request_output_len",
        "end_id",
        "pad_id",
        "streaming",
        "stop",
        "beam_width",
        "return_log_probs",
        "return_context_logits",
        "return_generation_logits",
        "stop_words_list",
        "bad_words_list",
        "embedding_bias",
    }
    | set(SAMPLING)
    | IGNORED
    | set(UNSUPPORTED)
)
OUTPUT_NAMES = {
    "output_ids",
    "sequence_length",
    "cum_log_probs",
    "output_log_probs",
    "batch_index",
    "context_logits",
    "generation_logits",
}


@dataclass
class _TrtAsk(_Ask):
    pad: int = 0  # what fills output_ids past the sequence's end: pad_id, else end_id, else EOS


@dataclass
class _Row:
    """One sequence of a request: what it asks and what it has produced (with return_log_probs, the
    log prob of each token in `ids`)."""

    ask: _TrtAsk
    ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)


def _words(a: np.ndarray, name: str) -> list[list[int]]:
    """TensorRT-LLM's word list of one sequence, [2, n]: ids end to end, then each word's end offset
    (padded with -1), into the words' token ids."""
    if a.ndim != 2 or a.shape[0] != 2:
        raise BadRequest(f"{name}: a sequence's word list has shape [2, n], got {list(a.shape)}")
    ids, ends = a[0].tolist(), [int(e) for e in a[1] if e >= 0]
    words, start = [], 0
    for end in ends:
        if not start < end <= len(ids):
            raise BadRequest(f"{name}: the offsets must grow within the {len(ids)} ids, got {ends}")
        words.append([int(t) for t in ids[start:end]])
        start = end
    return words


class TrtLlmInstance(LLMInstance):
    """TensorRT-LLM's tensors in and out; the engine batches the sequences with every other request."""

    def __init__(
        self, cfg: TritonModelConfig, llm: Any, loop: asyncio.AbstractEventLoop, admission: Any
    ) -> None:
        super().__init__(cfg, llm, loop, admission=admission)
        # The config's own policy: the repository runs this model as decoupled either way, and a
        # model that is not answers each request once.
        self.declared_decoupled = bool(cfg.raw.get("model_transaction_policy", {}).get("decoupled", False))
        self.exclude_input = _flag(cfg.parameters.get("exclude_input_in_output", "false"))
        self.outputs = {t.name for t in cfg.outputs}
        self._eos = llm.tokenizer.eos_token_id or 0
        unused = sorted({t.name for t in cfg.inputs} - KNOWN_INPUTS)
        if unused:
            log.warning("model %s: inputs %s are accepted and not used here", cfg.name, ", ".join(unused))
        unmade = sorted(self.outputs - OUTPUT_NAMES)
        if unmade:
            log.warning("model %s: outputs %s are not produced here", cfg.name, ", ".join(unmade))

    # -- requests -------------------------------------------------------------------------------------
    def _value(self, req: InferRequest, name: str, row: int) -> Any:
        a = req.inputs.get(name)
        if a is None:
            return None
        v = a[row].reshape(-1) if a.ndim > 1 or self.cfg.batched else a.reshape(-1)
        if v.size != 1:
            raise BadRequest(f"{name!r} takes one value per sequence, got {v.size}")
        return v[0].item()

    def _rows(self, req: InferRequest) -> int:
        ids = req.inputs.get("input_ids")
        if ids is None:
            raise BadRequest(f"model {self.cfg.name!r} needs input_ids")
        return ids.shape[0] if self.cfg.batched else 1

    def _asks(self, req: InferRequest) -> list[_Ask]:
        for name, what in UNSUPPORTED.items():
            a = req.inputs.get(name)
            if a is not None and a.size and np.any(a != (b"" if a.dtype == object else 0)):
                raise BadRequest(f"{name}: {what} are not supported here")
        n = self._rows(req)
        if n > 1 and any(_flag(self._value(req, "streaming", i)) for i in range(n)):
            raise BadRequest("a streaming request has one sequence (send each as its own request)")
        return [self._row(req, i) for i in range(n)]

    def _row(self, req: InferRequest, i: int) -> _Ask:
        ids = req.inputs["input_ids"]
        tokens = (ids[i] if self.cfg.batched else ids).reshape(-1)
        length = self._value(req, "input_lengths", i)
        if length is not None:
            if not 0 < int(length) <= tokens.size:
                raise BadRequest(f"input_lengths {length} is outside 1..{tokens.size}, the ids sent")
            tokens = tokens[: int(length)]
        prompt = [int(t) for t in tokens]
        vocab = self.llm.tokenizer.vocab_size
        if not prompt or any(t < 0 or t >= vocab for t in prompt):
            raise BadRequest(f"input_ids: a non-empty prompt of ids in 0..{vocab - 1}")
        if _flag(self._value(req, "stop", i)):
            raise BadRequest("stop: cancel a request by closing its stream or connection")
        beams = self._value(req, "beam_width", i)
        if beams is not None and int(beams) != 1:
            raise BadRequest(f"beam_width {beams}: beam search is not supported here (1 only)")
        for name in ("return_context_logits", "return_generation_logits"):
            if _flag(self._value(req, name, i)):
                raise BadRequest(f"{name}: logits are not returned here")
        out_len = self._value(req, "request_output_len", i)
        if out_len is None:
            raise BadRequest("request_output_len is required")
        values: dict[str, Any] = {}
        try:
            max_tokens = int(out_len)
            for name, (key, conv) in SAMPLING.items():
                v = self._value(req, name, i)
                if v is not None:
                    values[key] = conv(v)
        except (TypeError, ValueError, OverflowError) as e:
            raise BadRequest(f"a sampling setting is not a number: {e}") from None
        # TensorRT-LLM decodes greedily unless asked to sample: top_k 0 (or unset) with top_p 0 (or
        # unset), or top_k 1; a top_p of 0 is "off", not an empty nucleus.
        if values.get("top_p") == 0.0:
            del values["top_p"]
        if values.get("top_k", 0) in (0, 1) and (values.get("top_k") == 1 or "top_p" not in values):
            values.pop("top_k", None)
            values.pop("top_p", None)
            values["temperature"] = 0.0
        if max_tokens < 1:
            raise BadRequest(f"request_output_len must be >= 1, got {max_tokens}")
        limit = self.llm.max_model_len
        if len(prompt) + max_tokens > limit:
            raise BadRequest(
                f"this model's context is {limit} tokens: the prompt's {len(prompt)} and "
                f"request_output_len {max_tokens} do not fit"
            )
        end_id = self._value(req, "end_id", i)
        stops, bias = [], {}
        for name in ("stop_words_list", "bad_words_list"):
            a = req.inputs.get(name)
            words = _words(a[i] if self.cfg.batched else a, name) if a is not None else []
            if name == "stop_words_list":
                stops = words
            else:
                for w in words:
                    if len(w) != 1:
                        raise BadRequest("bad_words_list: words of one token only here")
                    bias[w[0]] = -math.inf
        emb = req.inputs.get("embedding_bias")
        if emb is not None and emb.size:
            row = np.asarray(emb[i] if self.cfg.batched else emb, dtype=np.float32).reshape(-1)
            if not np.isfinite(row).all():
                raise BadRequest("embedding_bias: every value must be a finite number")
            for t in np.flatnonzero(row):
                bias[int(t)] = bias.get(int(t), 0.0) + float(row[t])
        if end_id is not None:
            # TensorRT-LLM ends at end_id alone: the model's own EOS is then a token like any other.
            values.update(stop_token_ids=[int(end_id)], ignore_eos=True)
        try:
            params = SamplingParams(
                max_tokens=max_tokens,
                stop_token_sequences=stops,
                logit_bias=bias,
                logprobs=0 if _flag(self._value(req, "return_log_probs", i)) else None,
                skip_special_tokens=False,
                **values,
            )
        except (TypeError, ValueError, OverflowError) as e:
            raise BadRequest(str(e)) from None
        stream = _flag(self._value(req, "streaming", i))
        if stream and not self.declared_decoupled:
            raise BadRequest(
                f"model {self.cfg.name!r}: streaming needs model_transaction_policy {{ decoupled: true }}"
            )
        if stream and req.one_response:  # refused before it runs, not after all its pieces are made
            raise BadRequest(
                "streaming: this call takes one response; stream with gRPC ModelStreamInfer or "
                "POST /v2/models/<name>/generate_stream"
            )
        pad = self._value(req, "pad_id", i)
        pad = int(pad if pad is not None else end_id if end_id is not None else self._eos)
        return _TrtAsk(prompt, None, params, stream, pad)

    # -- responses ------------------------------------------------------------------------------------
    async def _respond(self, asks: list[_Ask], lora: Any, stream: ResponseStream) -> None:
        rows = [_Row(cast(_TrtAsk, a)) for a in asks]  # (made by _row)
        if asks[0].stream:
            await self._sequence(rows[0], stream, streaming=True)
            return
        tasks = [asyncio.ensure_future(self._sequence(r, stream, streaming=False)) for r in rows]
        try:
            await asyncio.gather(*tasks)
        finally:  # one sequence failed (or the request went): the others are aborted, not left running
            for t in tasks:
                t.cancel()
        if not stream.closed:
            stream.send(StreamItem(self._assemble(rows), final=True))

    async def _sequence(self, row: _Row, stream: ResponseStream, streaming: bool) -> None:
        """Run one sequence to its end; when streaming, each new piece is a response."""
        rid = f"trtllm-{self.cfg.name}-{next(self._ids)}"
        gen = self.llm.generate(rid, row.ask.prompt_ids, row.ask.params)
        try:
            async for ro in gen:
                if stream.cancelled or stream.closed:  # the reader has gone: closing aborts the request
                    stream.fail("cancelled")
                    return
                o = ro.outputs[0]
                before = len(row.ids)
                new = list(o.delta_token_ids)
                if o.finish_reason is not None and isinstance(o.stop_reason, int) and new:
                    new = new[:-1]  # the end token ended it; TensorRT-LLM leaves it out of the output
                row.ids.extend(new)
                if o.logprobs is not None:  # (the whole sequence's so far: only the new ones are read)
                    row.logprobs += [lp.logprob for lp in o.logprobs[len(row.logprobs) : len(row.ids)]]
                if streaming and (new or o.finish_reason is not None):
                    piece = _Row(row.ask, row.ids[before:], row.logprobs[before:])
                    out = self._assemble([piece], streamed=True, cum=[sum(row.logprobs)])
                    stream.send(StreamItem(out, final=o.finish_reason is not None))
                if o.finish_reason is not None:
                    return
        finally:
            await gen.aclose()
        stream.fail(f"model {self.cfg.name!r}: the engine ended the request without finishing it")

    def _assemble(self, rows: list[_Row], streamed: bool = False, cum: list[float] | None = None) -> Outputs:
        """TensorRT-LLM's output tensors for `rows` (one beam each), padded to the longest. `cum`: the
        sequences' log probs so far, where `rows` hold only a streamed piece of each."""
        seqs = [r.ids if streamed or self.exclude_input else [*r.ask.prompt_ids, *r.ids] for r in rows]
        width = max(len(s) for s in seqs)
        ids = np.full((len(rows), 1, width), 0, dtype=np.int32)
        logprobs = np.zeros((len(rows), 1, max(len(r.ids) for r in rows)), dtype=np.float32)
        for i, (r, s) in enumerate(zip(rows, seqs, strict=True)):
            ids[i, 0, : len(s)] = s
            ids[i, 0, len(s) :] = r.ask.pad
            logprobs[i, 0, : len(r.logprobs)] = r.logprobs
        out: Outputs = {
            "output_ids": ids,
            "sequence_length": np.array([[len(s)] for s in seqs], dtype=np.int32),
            "cum_log_probs": logprobs.sum(axis=2) if cum is None else np.array([cum], np.float32).T,
            "output_log_probs": logprobs,
            "batch_index": np.arange(len(rows), dtype=np.int32).reshape(-1, 1),
            # Not asked for (asking is refused): TensorRT-LLM's placeholders, so ensembles that pass
            # them on still run.
            "context_logits": np.zeros((len(rows), 1, 1), dtype=np.float32),
            "generation_logits": np.zeros((len(rows), 1, 1, 1), dtype=np.float32),
        }
        if not self.cfg.batched:  # (max_batch_size 0: the config's shapes have no batch dimension)
            out = {k: v[0] for k, v in out.items()}
        return {k: v for k, v in out.items() if k in self.outputs}
