"""A client that streams completions back to back, for the fleet tests that change the fleet under load
(drains, scale-downs): each stream is recorded "ok" only if it carried every token asked for, ended with
finish reason "length" and then `[DONE]`; otherwise what went wrong."""

from __future__ import annotations

import asyncio
import json

import httpx


async def stream_until(
    base: str, stop: asyncio.Event, results: list[str], prompt: str, max_tokens: int
) -> None:
    body = {"model": "smollm2-135m", "prompt": prompt, "max_tokens": max_tokens, "ignore_eos": True,
            "stream": True, "stream_options": {"include_usage": True}}  # fmt: skip
    async with httpx.AsyncClient(base_url=base, timeout=120) as client:
        while not stop.is_set():
            tokens, finish, done = 0, None, False
            try:
                async with client.stream("POST", "/v1/completions", json=body) as r:
                    if r.status_code != 200:
                        results.append(f"HTTP {r.status_code}: {(await r.aread())[:200]!r}")
                        continue
                    async for line in r.aiter_lines():
                        if line == "data: [DONE]":
                            done = True
                            break
                        if not line.startswith("data: {"):
                            continue
                        chunk = json.loads(line[len("data: ") :])
                        if "error" in chunk:
                            finish = line
                            break
                        if chunk.get("usage"):  # the last chunk: the tokens the stream carried
                            tokens = chunk["usage"]["completion_tokens"]
                        for choice in chunk.get("choices", []):
                            finish = choice.get("finish_reason") or finish
            except httpx.HTTPError as e:
                results.append(f"{type(e).__name__}: {e}")
                continue
            ok = done and finish == "length" and tokens == max_tokens
            results.append("ok" if ok else f"cut: {tokens} tokens, {finish}, [DONE] {done}")
