"""/v1/completions and /v1/chat/completions over the asyncio frontend, streaming (SSE) or not.

Output constraints (response_format, structured_outputs, guided_*) and tool calling are turned into a
SamplingParams.structured constraint here, checked by a grammar backend first (a bad schema is a 400,
not a failed generation); tool-call prompts and parsing live in tool_calls.py."""

from __future__ import annotations

import asyncio
import functools
import json
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from tokenmill.config import EngineConfig
from tokenmill.engine.client import (
    EngineDeadError,
    RequestFailedError,
    RequestInvalidError,
    RequestRejectedError,
)
from tokenmill.engine.protocol import worker_secret
from tokenmill.frontend.async_llm import AsyncLLM, RequestShedError
from tokenmill.outputs import CompletionOutput, RequestOutput
from tokenmill.sampling_params import SamplingParams, StructuredOutputs
from tokenmill.server import kv_transfer_params
from tokenmill.server.admission import Admission, Ticket
from tokenmill.server.errors import APIError, engine_unavailable, error_body
from tokenmill.server.lora_registry import LoRARegistry
from tokenmill.server.openai_protocol import (
    ChatCompletionRequest,
    ChatMessage,
    CompletionRequest,
    NamedToolChoice,
    RequestFieldError,
    now,
)
from tokenmill.server.reasoning import reasoning_parser, reply_parser
from tokenmill.server.tool_calls import (
    ParsedDelta,
    ToolCallParser,
    ToolPlan,
    finish_reason,
    parse_reply,
    plan_tools,
    template_messages,
)
from tokenmill.server.tool_parsers import NEEDS_SPECIAL_TOKENS, tool_format
from tokenmill.tokenizer.chat_template import ChatTemplateError

if TYPE_CHECKING:
    from tokenmill.structured import GrammarBackend


def sse(obj: Any) -> str:
    return f"data: {json.dumps(obj, separators=(',', ':'))}\n\n"


def sse_event(payload: dict[str, Any]) -> str:
    """A typed event (the Responses and Messages APIs): its `type` as the SSE event name too."""
    return f"event: {payload['type']}\n" + sse(payload)


class OpenAIServing:
    def __init__(
        self,
        llm: AsyncLLM,
        model_name: str,
        admission: Admission,
        tool_parser: str = "auto",
        reasoning: str | None = None,
    ) -> None:
        self.llm = llm
        self.model_name = model_name
        self.admission = admission
        # The LoRA adapters served beside the base model (replaced by the server state's when it has any).
        self.loras = LoRARegistry(model_name, None, 0, enabled=False)
        # How the model writes the calls it chooses to make, and how it marks its reasoning.
        self.tool_format = tool_format(tool_parser, llm.tokenizer.chat_template)
        self.reasoning = reasoning_parser(reasoning)
        # The engine's config, where the server has it (its KV transfer peers); set by the server state.
        self.engine_config: EngineConfig | None = None
        # Built on the first constrained request (it reads the whole vocabulary, ~0.2 s).
        self._grammars: GrammarBackend | None = None
        self._grammars_lock = asyncio.Lock()

    # -- input checks ---------------------------------------------------------------------------
    def check_model(self, model: str | None) -> None:
        if model is not None and not self.loras.knows(model):
            served = ", ".join(f"`{m}`" for m in (self.model_name, *self.loras.adapters))
            raise APIError(404, f"The model `{model}` does not exist; this server serves {served}.", "model")

    def served(self, model: str | None) -> str:
        """The model name a reply carries: the adapter asked for, or the base model."""
        return model if model is not None and model in self.loras.adapters else self.model_name

    def check_length(self, n_prompt: int, max_tokens: int | None) -> int | None:
        """Validate against the context length; return max_tokens (None: up to the context)."""
        limit = self.llm.max_model_len
        if n_prompt >= limit:
            raise APIError(
                400,
                f"This model's maximum context length is {limit} tokens, but the prompt has {n_prompt} "
                f"tokens. Shorten the prompt to at most {limit - 1} tokens.",
                "messages",
            )
        if max_tokens is not None and n_prompt + max_tokens > limit:
            raise APIError(
                400,
                f"This model's maximum context length is {limit} tokens; you requested "
                f"{n_prompt + max_tokens} ({n_prompt} in the prompt, {max_tokens} for the completion). "
                f"Lower max_tokens to at most "
                f"{limit - n_prompt} or shorten the prompt.",
                "max_tokens",
            )
        return max_tokens

    def params(
        self,
        req: CompletionRequest | ChatCompletionRequest,
        n_prompt: int,
        max_tokens,
        logprobs,
        structured: StructuredOutputs | None = None,
    ):
        max_tokens = self.check_length(n_prompt, max_tokens)
        try:
            return req.sampling_params(max_tokens, logprobs, structured)
        except ValueError as e:
            raise APIError(400, str(e)) from e

    # -- output constraints ---------------------------------------------------------------------
    async def output_constraint(
        self, req: CompletionRequest | ChatCompletionRequest, plan: ToolPlan | None = None
    ) -> StructuredOutputs | None:
        """The request's constraint (from response_format, structured_outputs, guided_* or its tool
        choice), checked by the grammar backend; APIError 400 naming the field otherwise."""
        try:
            found = req.output_constraint()
        except RequestFieldError as e:
            raise APIError(400, str(e), e.param) from e
        tool_spec = plan.constraint() if plan is not None else None
        if plan is not None and plan.mode != "none":
            # Each tool's parameters on their own first, so that an error names the tool.
            for name in plan.names:
                spec = StructuredOutputs(json=json.dumps(plan.parameters(name)))
                await self.check_grammar(spec, "tools", f"tool {name!r}: parameters: ")
        if tool_spec is not None:
            if found is not None:
                choice = "'required'" if plan and plan.mode == "required" else "a named function"
                raise APIError(
                    400,
                    f"tool_choice {choice} constrains the output to tool calls; it cannot be combined "
                    f"with {found[1]}",
                    found[1],
                )
            await self.check_grammar(tool_spec, "tools", "tools: ")
            return tool_spec
        if found is None:
            return None
        await self.check_grammar(found[0], found[1], f"{found[1]}: ")
        return found[0]

    async def check_grammar(self, spec: StructuredOutputs, param: str, prefix: str) -> None:
        backend = await self.grammar_backend()
        if backend is None:
            return  # no grammar package here: the engine reports a bad spec when it compiles it
        from tokenmill.structured import GrammarError

        try:
            # Compiling a large schema takes a while: off the event loop.
            await asyncio.to_thread(backend.check, spec)
        except GrammarError as e:
            raise APIError(400, f"{prefix}{e}", param) from e

    async def grammar_backend(self) -> GrammarBackend | None:
        if self._grammars is not None:
            return self._grammars
        try:
            from tokenmill.structured import GrammarBackend
        except ImportError:
            return None
        async with self._grammars_lock:
            if self._grammars is None:
                tok = self.llm.tokenizer
                vocab = int(self.llm.client.info.get("vocab_size") or tok.vocab_size)
                self._grammars = await asyncio.to_thread(GrammarBackend, tok, vocab)
        return self._grammars

    def vocab_check(self, ids: list[int]) -> None:
        vocab = self.llm.client.info.get("vocab_size", 1 << 62)
        if any(not 0 <= t < vocab for t in ids):
            raise APIError(400, f"prompt token ids must be in [0, {vocab})", "prompt")

    # -- completions ----------------------------------------------------------------------------
    def check_text_fits(self, texts: list[str], param: str) -> None:
        """Refuse, before tokenizing, text too long to fit the context whatever it encodes to: a 20 MB
        prompt took the tokenizer 30 s to count out for a 400."""
        tok, limit = self.llm.tokenizer, self.llm.max_model_len
        for text in texts:
            if (floor := tok.token_floor(text)) >= limit:
                raise APIError(
                    400,
                    f"This model's maximum context length is {limit} tokens, but the prompt has more than "
                    f"{floor} tokens ({len(text)} characters). Shorten the prompt.",
                    param,
                )

    async def encode(
        self, texts: list[str], param: str = "prompt", add_special_tokens: bool = True
    ) -> list[list[int]]:
        """Token ids of each text, off the event loop (health checks and streams go on meanwhile)."""
        self.check_text_fits(texts, param)
        tok = self.llm.tokenizer
        return await asyncio.to_thread(lambda: [tok.encode(t, add_special_tokens) for t in texts])

    async def completion_prompts(self, req: CompletionRequest) -> list[tuple[str | None, list[int]]]:
        p = req.prompt
        if isinstance(p, str):
            return [(p, (await self.encode([p]))[0])]
        if all(isinstance(x, int) for x in p):
            return [(None, list(p))]  # type: ignore[arg-type]
        if all(isinstance(x, str) for x in p):
            texts: list[str] = list(p)  # type: ignore[arg-type]
            return list(zip(texts, await self.encode(texts), strict=True))
        return [(None, list(x)) for x in p]  # type: ignore[arg-type]

    async def encode_chat(
        self, messages: list[dict], add_generation_prompt: bool, extra: dict, param: str = "messages"
    ) -> list[int]:
        """A chat's prompt ids, off the event loop, after the same length check as a prompt's."""
        self.check_text_fits(["".join(_texts(messages))], param)
        tok = self.llm.tokenizer
        try:
            return await asyncio.to_thread(
                tok.encode_chat, messages, add_generation_prompt=add_generation_prompt, **extra
            )
        except ChatTemplateError as e:
            raise APIError(400, f"could not apply the chat template: {e}", param) from e

    async def completions(self, req: CompletionRequest, ticket: Ticket) -> dict | AsyncIterator[str]:
        self.check_model(req.model)
        prompts = await self.completion_prompts(req)
        max_tokens = req.max_tokens if req.max_tokens is not None else 16
        structured = await self.output_constraint(req)
        jobs = []
        for text, ids in prompts:
            if not ids:
                raise APIError(400, "prompt must not be empty", "prompt")
            self.vocab_check(ids)
            p = self.params(req, len(ids), max_tokens, req.logprobs, structured)
            if req.echo and req.logprobs is not None and p.prompt_logprobs is None:
                p.prompt_logprobs = req.logprobs  # the echoed prompt's tokens come with theirs
            if req.best_of is not None and req.best_of > req.n:
                p.n = req.best_of  # the best n of them go back, by their total logprob
                p.logprobs = p.logprobs if p.logprobs is not None else 0
            jobs.append((text, ids, p))
        self.check_kv_transfer(req, len(jobs), max(p.n for _, _, p in jobs))
        self.admission.add_work(ticket, sum(p.n for _, _, p in jobs), sum(len(ids) for _, ids, _ in jobs))
        rid = f"cmpl-{uuid.uuid4().hex}"
        if req.stream:
            return self._stream_completion(rid, req, jobs)
        return await self._full_completion(rid, req, jobs)

    async def _full_completion(self, rid: str, req: CompletionRequest, jobs) -> dict:
        results = await asyncio.gather(
            *(self._final(f"{rid}-{i}", ids, p, req) for i, (_, ids, p) in enumerate(jobs))
        )
        choices, prompt_tokens, completion_tokens, cached = [], 0, 0, 0
        for i, ((text, ids, _), ro) in enumerate(zip(jobs, results, strict=True)):
            prompt_tokens += len(ids)
            cached += ro.num_cached_tokens
            completion_tokens += sum(len(o.token_ids) for o in ro.outputs)  # best_of: all were made
            outputs = ro.outputs
            if len(outputs) > req.n:  # best_of
                outputs = sorted(outputs, key=lambda o: -(o.cumulative_logprob or 0.0))[: req.n]
            for rank, o in enumerate(outputs):
                echo = self._echo(text, ids, ro) if req.echo else None
                logprobs = None
                if req.logprobs is not None:
                    logprobs = self._completion_logprobs(o, prompt=echo)
                choice: dict[str, Any] = {
                    "index": i * req.n + rank,
                    "text": (echo[0] if echo else "") + o.text,
                    "logprobs": logprobs,
                    "finish_reason": o.finish_reason,
                    "stop_reason": o.stop_reason,
                }
                if req.prompt_logprobs is not None:
                    choice["prompt_logprobs"] = self._prompt_logprobs(ro)
                choices.append(choice)
        reply = {
            "id": rid,
            "object": "text_completion",
            "created": now(),
            "model": self.served(req.model),
            "choices": choices,
            "usage": usage(prompt_tokens, completion_tokens, cached),
        }
        return with_kv_transfer(reply, results[0])

    def _echo(
        self, text: str | None, ids: list[int], ro: RequestOutput
    ) -> tuple[str, list[int], list | None]:
        """The echoed prompt: its text, its token ids, and their logprobs (None first) when asked for."""
        return (text if text is not None else self.llm.tokenizer.decode(ids), ids, ro.prompt_logprobs)

    def _prompt_logprobs(self, ro: RequestOutput) -> list[dict | None] | None:
        """vLLM's `prompt_logprobs`: per prompt token (None for the first) its logprob and the top
        alternatives', keyed by token id, with the decoded token."""
        if ro.prompt_logprobs is None:
            return None
        tok = self.llm.tokenizer
        out: list[dict | None] = []
        for lp in ro.prompt_logprobs:
            if lp is None:
                out.append(None)
                continue
            entries = {lp.token_id: lp.logprob, **dict(lp.top)}
            out.append(
                {
                    str(t): {"logprob": v, "decoded_token": tok.decode([t], skip_special_tokens=False)}
                    for t, v in entries.items()
                }
            )
        return out

    async def _stream_completion(self, rid: str, req: CompletionRequest, jobs) -> AsyncIterator[str]:
        include_usage = bool(req.stream_options and req.stream_options.include_usage)
        continuous = bool(req.stream_options and req.stream_options.continuous_usage_stats)
        head = {"id": rid, "object": "text_completion", "created": now(), "model": self.served(req.model)}
        prompt_tokens = sum(len(ids) for _, ids, _ in jobs)
        cached = 0
        made: dict[tuple[int, int], int] = {}  # tokens so far per (prompt, sequence)
        echoed: set[tuple[int, int]] = set()
        try:
            async for i, n, ro in self._merged(rid, req, jobs):
                cached = max(cached, ro.num_cached_tokens)
                for o in ro.outputs:
                    if not (o.delta_text or o.delta_token_ids or o.finished):
                        continue
                    made[(i, o.index)] = len(o.token_ids)
                    chunks: list[dict[str, Any]] = []
                    if req.echo and (i, o.index) not in echoed:  # the prompt first, as OpenAI echoes it
                        echoed.add((i, o.index))
                        text, ids, _ = jobs[i]
                        echo = self._echo(text, ids, ro)
                        logprobs = (
                            self._completion_logprobs(None, prompt=echo) if req.logprobs is not None else None
                        )
                        chunks.append(
                            {
                                "index": i * n + o.index,
                                "text": echo[0],
                                "logprobs": logprobs,
                                "finish_reason": None,
                                "stop_reason": None,
                            }
                        )
                    choice = {
                        "index": i * n + o.index,
                        "text": o.delta_text,
                        "logprobs": None,
                        "finish_reason": o.finish_reason,
                        "stop_reason": o.stop_reason if o.finished else None,
                    }
                    if o.logprobs is not None and o.delta_token_ids:
                        choice["logprobs"] = self._completion_logprobs(o, len(o.delta_token_ids))
                    chunks.append(choice)
                    for chunk in chunks:
                        body: dict[str, Any] = {**head, "choices": [chunk]}
                        if continuous:
                            body["usage"] = usage(prompt_tokens, sum(made.values()), cached)
                        yield sse(body)
        except Exception as e:  # the status line is sent: report the error in the stream
            yield sse(stream_error(e))
        else:
            if include_usage:
                yield sse({**head, "choices": [], "usage": usage(prompt_tokens, sum(made.values()), cached)})
        yield "data: [DONE]\n\n"

    def _generate(self, rid: str, ids: list[int], p: SamplingParams, req) -> AsyncIterator[RequestOutput]:
        """The engine's outputs for one prompt of a request, with the request's priority, cache salt,
        session and adapter."""
        kv_transfer = None
        if getattr(req, "kv_transfer_params", None) is not None:  # checked before: check_kv_transfer
            kv_transfer = kv_transfer_params.to_engine(req.kv_transfer_params, self.block_size, self.kv_peers)
        return self.llm.generate(
            rid, ids, p, priority=req.priority, cache_salt=req.cache_salt, routing_key=req.user,
            lora=self.loras.get(req.model), kv_transfer=kv_transfer,
        )  # fmt: skip

    @property
    def block_size(self) -> int:
        return int(self.llm.client.info.get("block_size", 16))

    @functools.cached_property
    def kv_peers(self) -> set[str] | None:
        """Transfer servers a client's kv_transfer_params may name (None: any, the secret guards them)."""
        if worker_secret() is not None:
            return None
        return self.engine_config.kv_transfer.allowed_peers() if self.engine_config else set()

    def check_kv_transfer(self, req: CompletionRequest | ChatCompletionRequest, prompts: int, n: int) -> None:
        """kv_transfer_params of the right shape, on a request a prefill/decode pair can split: one prompt,
        one sequence, not streamed from the prefill side."""
        if req.kv_transfer_params is None:
            return
        kt = kv_transfer_params.to_engine(req.kv_transfer_params, self.block_size, self.kv_peers)
        if kt is not None and (prompts > 1 or n > 1):
            raise APIError(400, "kv_transfer_params takes one prompt and n=1", kv_transfer_params.PARAM)
        if kt is not None and kt.get("do_remote_decode") and req.stream:
            raise APIError(400, "a remote-decode prefill is not streamed (stream=false)", "stream")

    async def _merged(self, rid: str, req, jobs) -> AsyncIterator[tuple[int, int, RequestOutput]]:
        """(prompt index, n, output) from the generations of all prompts of one request, as they come."""
        if len(jobs) == 1:  # the common case needs no extra task and queue hop per token
            _, ids, p = jobs[0]
            async for ro in self._generate(f"{rid}-0", ids, p, req):
                yield 0, p.n, ro
            return
        queue: asyncio.Queue = asyncio.Queue()

        async def pump(i: int, ids: list[int], p: SamplingParams) -> None:
            try:
                async for ro in self._generate(f"{rid}-{i}", ids, p, req):
                    await queue.put((i, p.n, ro))
            except Exception as e:  # handed to the consumer, which owns the response
                await queue.put(e)
            finally:
                await queue.put(None)

        tasks = [asyncio.create_task(pump(i, ids, p)) for i, (_, ids, p) in enumerate(jobs)]
        try:
            done = 0
            while done < len(tasks):
                item = await queue.get()
                if item is None:
                    done += 1
                elif isinstance(item, Exception):
                    raise item
                else:
                    yield item
        finally:
            for t in tasks:
                t.cancel()

    async def _final(self, rid: str, ids: list[int], p: SamplingParams, req) -> RequestOutput:
        last = None
        try:
            async for ro in self._generate(rid, ids, p, req):
                last = ro
        except (RequestRejectedError, EngineDeadError, RequestFailedError, RequestShedError) as e:
            raise generation_error(e) from e
        assert last is not None
        return last

    def _completion_logprobs(
        self, o: CompletionOutput | None, last_n: int | None = None, prompt: tuple | None = None
    ) -> dict:
        """The completions API's logprobs of a sequence's tokens (its last `last_n`), after those of the
        echoed prompt when given ((text, ids, logprobs with None first)); offsets count from the start
        of the choice's text."""
        tok = self.llm.tokenizer
        entries: list[tuple[int, float | None, list]] = []
        if prompt is not None:
            _, ids, plps = prompt
            for k, t in enumerate(ids):
                lp = plps[k] if plps is not None and k < len(plps) else None
                entries.append((t, None if lp is None else lp.logprob, [] if lp is None else lp.top))
        lps = (o.logprobs or []) if o is not None else []
        if last_n is not None:
            lps = lps[-last_n:]
        entries += [(lp.token_id, lp.logprob, lp.top) for lp in lps]
        tokens = [tok.decode([t], skip_special_tokens=False) for t, _, _ in entries]
        return {
            "tokens": tokens,
            "token_logprobs": [v for _, v, _ in entries],
            "top_logprobs": [
                None if v is None else {tok.decode([t], skip_special_tokens=False): x for t, x in top}
                for _, v, top in entries
            ],
            "text_offset": _offsets(tokens),
        }

    # -- chat -----------------------------------------------------------------------------------
    async def prepare_chat(self, req: ChatCompletionRequest, param: str = "messages") -> PreparedChat:
        """A chat request made ready to run: its tool plan, prompt ids and sampling parameters. The
        Responses and Messages APIs translate their requests to a chat request and come through here,
        so that every check (model, tools, constraints, template, context length) is the same."""
        self.check_model(req.model)
        tools = [t.model_dump(exclude_none=True) for t in req.tools or []]
        choice = req.tool_choice
        if isinstance(choice, NamedToolChoice):
            choice = choice.model_dump()
        tok = self.llm.tokenizer
        # A template that does not list tools gets this server's tool prompt, which asks for Hermes'.
        fmt = self.tool_format if tok.supports_tools else "hermes"
        try:
            plan = plan_tools(tools, choice, req.parallel_tool_calls, fmt)
        except RequestFieldError as e:
            raise APIError(400, str(e), e.param) from e
        structured = await self.output_constraint(req, plan)
        dicts = [chat_message_dict(m) for m in req.messages]
        prefill = ""
        if req.continue_final_message:
            if dicts[-1].get("role") != "assistant" or dicts[-1].get("tool_calls"):
                raise APIError(400, "continuing the final message needs it to be an assistant's text", param)
            prefill = str(dicts.pop()["content"])
        messages, prompt_tools = template_messages(dicts, plan, tok.supports_tools)
        extra = {"tools": prompt_tools} if prompt_tools else {}
        ids = await self.encode_chat(messages, req.add_generation_prompt or bool(prefill), extra, param)
        if prefill:  # the reply goes on from the text the assistant turn already holds
            ids += (await self.encode([prefill], param, add_special_tokens=False))[0]
        max_tokens = req.max_completion_tokens or req.max_tokens
        logprobs = (req.top_logprobs or 0) if req.logprobs else None
        params = self.params(req, len(ids), max_tokens, logprobs, structured)
        if plan is not None and plan.mode == "auto" and plan.format in NEEDS_SPECIAL_TOKENS:
            params.skip_special_tokens = False  # the format's tags are special tokens
        return PreparedChat(ids, params, plan)

    def reply_parser(self, prep: PreparedChat) -> ToolCallParser | None:
        """What splits a reply: reasoning from the answer (with a reasoning parser; not for constrained
        output, which is constrained from its first token and holds no reasoning), calls from text."""
        tools = prep.plan.parser() if prep.plan is not None else None
        reasoning = self.reasoning if prep.params.structured is None else None
        return reply_parser(reasoning, tools)

    async def chat(self, req: ChatCompletionRequest, ticket: Ticket) -> dict | AsyncIterator[str]:
        prep = await self.prepare_chat(req)
        ids, p = prep.ids, prep.params
        self.check_kv_transfer(req, 1, p.n)
        self.admission.add_work(ticket, p.n, len(ids))
        rid = f"chatcmpl-{uuid.uuid4().hex}"
        if req.stream:
            return self._stream_chat(rid, req, prep)
        ro = await self._final(rid, ids, p, req)
        choices = [self._chat_choice(o, self.reply_parser(prep)) for o in ro.outputs]
        completion = sum(len(o.token_ids) for o in ro.outputs)
        reply = {
            "id": rid,
            "object": "chat.completion",
            "created": now(),
            "model": self.served(req.model),
            "choices": choices,
            "usage": usage(len(ids), completion, ro.num_cached_tokens),
        }
        if req.prompt_logprobs is not None:  # vLLM's: the rendered prompt's, beside the choices
            reply["prompt_logprobs"] = self._prompt_logprobs(ro)
        return with_kv_transfer(reply, ro)

    async def turn(self, rid: str, req: ChatCompletionRequest, prep: PreparedChat) -> AsyncIterator[TurnStep]:
        """One reply (n = 1) as it is generated, its text already split into content and tool-call
        fragments: what the Responses and Messages APIs shape into their own events. Engine errors come
        out as APIError."""
        parser = self.reply_parser(prep)
        try:
            async for ro in self._generate(rid, prep.ids, prep.params, req):
                o = ro.outputs[0]
                if parser is None:
                    parsed = ParsedDelta(content=o.delta_text)
                else:
                    parsed = parser.feed(o.delta_text) if o.delta_text else ParsedDelta()
                    if o.finished:
                        parsed.extend(parser.finish())
                calls = parser.calls_made if parser is not None else 0
                yield TurnStep(o, parsed, ro.num_cached_tokens, calls)
        except APIError:
            raise
        except Exception as e:
            raise generation_error(e) from e

    def _chat_choice(self, o: CompletionOutput, parser: ToolCallParser | None) -> dict[str, Any]:
        message: dict[str, Any] = {"role": "assistant", "content": o.text}
        reason = o.finish_reason
        if parser is not None:
            reasoning, content, calls = parse_reply(parser, o.text)
            message["content"] = content
            if self.reasoning is not None:
                message["reasoning_content"] = message["reasoning"] = reasoning or None
            if calls:
                message["tool_calls"] = calls
            reason = finish_reason(reason, len(calls))
        return {
            "index": o.index,
            "message": message,
            "logprobs": {"content": self._chat_logprobs(o.logprobs)} if o.logprobs is not None else None,
            "finish_reason": reason,
            "stop_reason": o.stop_reason,
        }

    async def _stream_chat(
        self, rid: str, req: ChatCompletionRequest, prep: PreparedChat
    ) -> AsyncIterator[str]:
        ids, p = prep.ids, prep.params
        include_usage = bool(req.stream_options and req.stream_options.include_usage)
        continuous = bool(req.stream_options and req.stream_options.continuous_usage_stats)
        created = now()
        model = self.served(req.model)
        head = {"id": rid, "object": "chat.completion.chunk", "created": created, "model": model}
        for i in range(p.n):
            yield sse(
                {
                    **head,
                    "choices": [
                        {
                            "index": i,
                            "delta": {"role": "assistant", "content": ""},
                            "logprobs": None,
                            "finish_reason": None,
                        }
                    ],
                }
            )
        last: RequestOutput | None = None
        # One per choice when the output may hold tool calls or reasoning.
        made = [self.reply_parser(prep) for _ in range(p.n)]
        parsers = {i: parser for i, parser in enumerate(made) if parser is not None}
        try:
            async for ro in self._generate(rid, ids, p, req):
                last = ro
                if continuous:  # vLLM's: the usage so far in every chunk
                    so_far = sum(len(o.token_ids) for o in ro.outputs)
                    head["usage"] = usage(len(ids), so_far, ro.num_cached_tokens)
                for o in ro.outputs:
                    if not (o.delta_text or o.finished):
                        continue
                    if o.index in parsers:
                        for chunk in self._tool_chunks(parsers[o.index], o):
                            yield sse({**head, "choices": [chunk]})
                        continue
                    choice: dict[str, Any] = {
                        "index": o.index,
                        "delta": {"content": o.delta_text} if o.delta_text else {},
                        "logprobs": None,
                        "finish_reason": o.finish_reason,
                    }
                    if o.logprobs is not None and o.delta_token_ids:
                        choice["logprobs"] = {
                            "content": self._chat_logprobs(o.logprobs[-len(o.delta_token_ids) :])
                        }
                    yield sse({**head, "choices": [choice]})
        except Exception as e:
            yield sse(stream_error(e))
            yield "data: [DONE]\n\n"
            return
        if include_usage and last is not None:
            completion = sum(len(o.token_ids) for o in last.outputs)
            yield sse({**head, "choices": [], "usage": usage(len(ids), completion, last.num_cached_tokens)})
        yield "data: [DONE]\n\n"

    def _tool_chunks(self, parser: ToolCallParser, o: CompletionOutput) -> list[dict[str, Any]]:
        """The stream choices for one step of a request with tools: content and call fragments as the
        parser releases them, then (when it ended) an empty delta with the finish reason."""
        parsed = parser.feed(o.delta_text) if o.delta_text else ParsedDelta()
        if o.finished:
            parsed.extend(parser.finish())
        deltas = parsed.deltas()
        logprobs = None
        if o.logprobs is not None and o.delta_token_ids:
            logprobs = {"content": self._chat_logprobs(o.logprobs[-len(o.delta_token_ids) :])}
            deltas = deltas or [{}]  # the step's logprobs go out even when its text is held back
        chunks = [
            {"index": o.index, "delta": d, "logprobs": logprobs if i == 0 else None, "finish_reason": None}
            for i, d in enumerate(deltas)
        ]
        if o.finished:
            reason = finish_reason(o.finish_reason, parser.calls_made)
            chunks.append({"index": o.index, "delta": {}, "logprobs": None, "finish_reason": reason})
        return chunks

    def _chat_logprobs(self, lps) -> list[dict]:
        tok = self.llm.tokenizer

        def entry(t: int, v: float) -> dict:
            s = tok.decode([t], skip_special_tokens=False)
            return {"token": s, "logprob": v, "bytes": list(s.encode())}

        return [
            {**entry(lp.token_id, lp.logprob), "top_logprobs": [entry(t, v) for t, v in lp.top]} for lp in lps
        ]


def with_kv_transfer(reply: dict[str, Any], ro: RequestOutput) -> dict[str, Any]:
    """A prefill server's reply says where its blocks can be read (vLLM's field)."""
    params = kv_transfer_params.from_engine(ro.kv_transfer)
    if params is not None:
        reply["kv_transfer_params"] = params
    return reply


def usage(prompt: int, completion: int, cached: int) -> dict:
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
        "prompt_tokens_details": {"cached_tokens": cached},
    }


def chat_message_dict(m: ChatMessage) -> dict[str, Any]:
    """A message as the chat template expects it: text content (parts joined), never null (an
    assistant message that only carried tool calls has content null in OpenAI's API)."""
    d = m.model_dump(exclude_none=True)
    content = d.get("content")
    if isinstance(content, list):
        d["content"] = "".join(str(part.get("text", "")) for part in content if part.get("type") == "text")
    elif content is None:
        d["content"] = ""
    return d


@dataclass
class PreparedChat:
    ids: list[int]
    params: SamplingParams
    plan: ToolPlan | None


@dataclass
class TurnStep:
    """One step of a reply: the engine's output so far, the step's text split into content and call
    fragments, the prompt tokens found cached, and how many calls the reply has begun."""

    output: CompletionOutput
    parsed: ParsedDelta
    cached_tokens: int
    calls_made: int


def generation_error(e: Exception) -> APIError:
    """The client's error for an engine error while generating."""
    if isinstance(e, EngineDeadError):  # its reason may name the engine's ipc:// socket: not for clients
        return APIError(503, engine_unavailable(e))
    if isinstance(e, RequestShedError):  # queued, and its place given to a more urgent request
        return APIError(503, str(e), headers={"Retry-After": "1"})
    if isinstance(e, RequestRejectedError | RequestInvalidError):  # invalid: its grammar gave out
        return APIError(400, str(e))
    if isinstance(e, RequestFailedError):
        return APIError(500, str(e))
    return APIError(500, f"internal error: {type(e).__name__}")


def stream_error(e: Exception) -> dict:
    err = e if isinstance(e, APIError) else generation_error(e)
    return error_body(err.status, err.message, err.param)


def _offsets(tokens: list[str]) -> list[int]:
    out, pos = [], 0
    for t in tokens:
        out.append(pos)
        pos += len(t)
    return out


def _texts(messages: list[dict]) -> list[str]:
    """The text of a chat's messages (string contents and text parts): a floor of what it encodes to."""
    out = []
    for m in messages:
        content = m.get("content")
        if isinstance(content, str):
            out.append(content)
        elif isinstance(content, list):
            out.extend(p["text"] for p in content if isinstance(p, dict) and isinstance(p.get("text"), str))
    return out
