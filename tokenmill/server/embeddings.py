"""`/v1/embeddings` (OpenAI's shape), and `/v1/score` and `/v1/rerank` (vLLM's) on the same path.

Every input runs through the engine's scheduler as an embedding request: its prompt is read in
chunks like any other, its final hidden states pooled, nothing sampled (pooling.py says how the model
pools). Scores are the cosine similarity of two embeddings, as vLLM scores with an embedding model.
"""

from __future__ import annotations

import asyncio
import base64
import math
import struct
import uuid
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from tokenmill.pooling import Pooling, finish
from tokenmill.sampling_params import SamplingParams
from tokenmill.server.admission import Admission, Ticket
from tokenmill.server.errors import APIError
from tokenmill.server.openai_protocol import INT32_MAX, TokenId, now
from tokenmill.server.openai_serving import OpenAIServing, generation_error

MAX_INPUTS = 2048  # OpenAI's limit on the inputs of one embeddings request
# Inputs of one request in the engine at once: a request of 2,048 (langchain sends 1,000) runs as many
# at a time, and counts as that many sequences in admission, not as 2,048 that could never be admitted.
IN_FLIGHT = 64

Inputs = str | list[str] | list[TokenId] | list[list[TokenId]]


class _PoolingFields(BaseModel):
    model_config = ConfigDict(extra="ignore", allow_inf_nan=False)

    model: str | None = None
    user: str | None = None
    # vLLM's extras.
    truncate_prompt_tokens: int | None = Field(default=None, ge=1, le=INT32_MAX)  # keep the last N tokens
    add_special_tokens: bool = True
    priority: int = Field(default=0, ge=-(2**63), le=2**63 - 1)


class EmbeddingRequest(_PoolingFields):
    input: Inputs
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = Field(default=None, ge=1, le=INT32_MAX)
    normalize: bool | None = None  # vLLM's: None takes the model's own setting

    @model_validator(mode="after")
    def _check(self) -> EmbeddingRequest:
        if isinstance(self.input, list) and not self.input:
            raise ValueError("input must not be empty")
        if (
            isinstance(self.input, list)
            and len(self.input) > MAX_INPUTS
            and not isinstance(self.input[0], int)
        ):
            raise ValueError(f"input takes at most {MAX_INPUTS} items")
        return self


class ScoreRequest(_PoolingFields):
    text_1: str | list[str]
    text_2: str | list[str]


class RerankRequest(_PoolingFields):
    query: str
    documents: list[str] = Field(min_length=1, max_length=MAX_INPUTS)
    top_n: int = Field(default=0, ge=0)  # 0: all


def _texts(input: Inputs) -> list[str | list[int]]:
    if isinstance(input, str):
        return [input]
    if all(isinstance(x, int) for x in input):
        return [list(input)]  # type: ignore[arg-type]
    return list(input)  # type: ignore[arg-type]


def _cosine(a: list[float], b: list[float]) -> float:
    dot = math.fsum(x * y for x, y in zip(a, b, strict=True))
    na, nb = math.sqrt(math.fsum(x * x for x in a)), math.sqrt(math.fsum(y * y for y in b))
    return dot / (na * nb) if na and nb else 0.0


def base64_floats(vector: list[float]) -> str:
    """OpenAI's base64 encoding: the float32 values little-endian, concatenated, base64 with padding."""
    return base64.b64encode(struct.pack(f"<{len(vector)}f", *vector)).decode()


class PoolingServing:
    def __init__(self, serving: OpenAIServing, admission: Admission, pooling: Pooling | str) -> None:
        """`pooling`: how the model pools, or why it cannot (the routes then answer 400 saying so)."""
        self.serving, self.admission, self._pooling = serving, admission, pooling

    @property
    def pooling(self) -> Pooling:
        if isinstance(self._pooling, str):
            raise APIError(400, f"this model gives no embeddings: {self._pooling}")
        return self._pooling

    async def _prompts(
        self, items: list[str | list[int]], req: _PoolingFields, param: str
    ) -> list[list[int]]:
        texts = [x for x in items if isinstance(x, str)]
        if any(not t for t in texts):
            raise APIError(400, f"{param} must not hold an empty string", param)
        encoded = iter(await self.serving.encode(texts, param, req.add_special_tokens) if texts else [])
        prompts = []
        limit = self.serving.llm.max_model_len
        for item in items:
            ids = next(encoded) if isinstance(item, str) else list(item)
            if not ids:
                raise APIError(400, f"{param} must not hold an empty list of tokens", param)
            self.serving.vocab_check(ids)
            if req.truncate_prompt_tokens is not None:
                ids = ids[-req.truncate_prompt_tokens :]
            if len(ids) >= limit:
                raise APIError(
                    400,
                    f"This model's maximum context length is {limit} tokens, but an input has {len(ids)} "
                    "tokens. Shorten it, or send truncate_prompt_tokens.",
                    param,
                )
            prompts.append(ids)
        return prompts

    async def _embed(
        self, prompts: list[list[int]], req: _PoolingFields, ticket: Ticket
    ) -> list[list[float]]:
        """The raw pooled vectors of the prompts, run through the engine IN_FLIGHT at a time."""
        params = SamplingParams(max_tokens=1, pooling=self.pooling.type)
        self.admission.add_work(ticket, min(len(prompts), IN_FLIGHT), sum(map(len, prompts)))
        rid = uuid.uuid4().hex
        slots = asyncio.Semaphore(IN_FLIGHT)

        async def one(i: int, ids: list[int]) -> list[float]:
            async with slots:
                return await run(i, ids)

        async def run(i: int, ids: list[int]) -> list[float]:
            last = None
            try:
                async for ro in self.serving.llm.generate(
                    f"embd-{rid}-{i}",
                    ids,
                    params,
                    priority=req.priority,
                    routing_key=req.user,
                    lora=self.serving.loras.get(req.model),
                ):
                    last = ro
            except Exception as e:
                raise generation_error(e) from e
            assert last is not None and last.outputs[0].embedding is not None
            return last.outputs[0].embedding

        return list(await asyncio.gather(*(one(i, ids) for i, ids in enumerate(prompts))))

    async def embeddings(self, req: EmbeddingRequest, ticket: Ticket) -> dict[str, Any]:
        self.serving.check_model(req.model)
        prompts = await self._prompts(_texts(req.input), req, "input")
        vectors = await self._embed(prompts, req, ticket)
        normalize = self.pooling.normalize if req.normalize is None else req.normalize
        try:
            finished = [finish(v, normalize, req.dimensions) for v in vectors]
        except ValueError as e:
            raise APIError(400, str(e), "dimensions") from e
        encode = base64_floats if req.encoding_format == "base64" else (lambda v: v)
        tokens = sum(map(len, prompts))
        return {
            "object": "list",
            "data": [
                {"object": "embedding", "index": i, "embedding": encode(v)} for i, v in enumerate(finished)
            ],
            "model": self.serving.served(req.model),
            "usage": {"prompt_tokens": tokens, "total_tokens": tokens},
        }

    async def score(self, req: ScoreRequest, ticket: Ticket) -> dict[str, Any]:
        """vLLM's /v1/score: text_1 against each text_2 (one to many), or pairwise (as many each)."""
        self.serving.check_model(req.model)
        left = [req.text_1] if isinstance(req.text_1, str) else req.text_1
        right = [req.text_2] if isinstance(req.text_2, str) else req.text_2
        if len(left) != 1 and len(left) != len(right):
            raise APIError(400, "text_1 takes one text, or as many as text_2", "text_1")
        if not right or len(left) + len(right) > MAX_INPUTS:
            raise APIError(400, f"text_2 takes 1 to {MAX_INPUTS - 1} texts", "text_2")
        prompts = await self._prompts([*left, *right], req, "text_1")
        vectors = await self._embed(prompts, req, ticket)
        lv, rv = vectors[: len(left)], vectors[len(left) :]
        pairs = [(lv[0] if len(lv) == 1 else lv[i], r) for i, r in enumerate(rv)]
        tokens = sum(map(len, prompts))
        return {
            "id": f"score-{uuid.uuid4().hex}",
            "object": "list",
            "created": now(),
            "model": self.serving.served(req.model),
            "data": [
                {"index": i, "object": "score", "score": _cosine(a, b)} for i, (a, b) in enumerate(pairs)
            ],
            "usage": {"prompt_tokens": tokens, "total_tokens": tokens},
        }

    async def rerank(self, req: RerankRequest, ticket: Ticket) -> dict[str, Any]:
        """vLLM's (and Jina's, Cohere's) /v1/rerank: the documents by their score against the query."""
        self.serving.check_model(req.model)
        prompts = await self._prompts([req.query, *req.documents], req, "documents")
        vectors = await self._embed(prompts, req, ticket)
        scored = sorted(((i, _cosine(vectors[0], v)) for i, v in enumerate(vectors[1:])), key=lambda x: -x[1])
        if req.top_n:
            scored = scored[: req.top_n]
        tokens = sum(map(len, prompts))
        return {
            "id": f"rerank-{uuid.uuid4().hex}",
            "model": self.serving.served(req.model),
            "usage": {"prompt_tokens": tokens, "total_tokens": tokens},
            "results": [
                {"index": i, "document": {"text": req.documents[i]}, "relevance_score": s} for i, s in scored
            ],
        }
