"""The HTTP side of the load generator: one OpenAI-compatible request, timed chunk by chunk.

Kept lean on purpose, because it shares the machine with what it measures: the response body is read
in raw pieces and split into server-sent events by hand (no per-line iterator), each piece is
timestamped once on arrival, and JSON is decoded only for events that carry data.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlsplit

import httpx

from tokenmill.bench.records import RequestRecord


def normalize_base_url(url: str) -> str:
    """'http://host:8000' or 'http://host:8000/v1/' -> 'http://host:8000/v1'."""
    url = url.strip().rstrip("/")
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.netloc:
        raise ValueError(f"--url {url!r} is not an http(s) URL like http://127.0.0.1:8000/v1")
    return url if parts.path not in ("", "/") else url + "/v1"


def discover_model(base: str, api_key: str | None = None, timeout: float = 30.0) -> str:
    """The first model /models lists; ValueError saying what to do when there is none."""
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    try:
        resp = httpx.get(f"{base}/models", headers=headers, timeout=min(timeout, 30.0))
    except httpx.HTTPError as e:
        raise ValueError(f"cannot reach {base}/models ({e}); is the server up?") from None
    if resp.status_code != 200:
        raise ValueError(
            f"{base}/models answered HTTP {resp.status_code}; pass --model (and --api-key if needed)"
        )
    try:
        return str(resp.json()["data"][0]["id"])
    except (ValueError, KeyError, IndexError, TypeError):
        raise ValueError(f"{base}/models lists no model; pass --model") from None


@dataclass
class ClientConfig:
    base_url: str
    model: str
    endpoint: str = "chat"  # chat | completions
    stream: bool = True
    api_key: str | None = None
    timeout_s: float = 600.0
    fixed_osl: bool = True  # ask for exactly max_tokens: ignore_eos + min_tokens (vLLM/tokenmill extras)
    extra_body: dict[str, Any] = field(default_factory=dict)


class OpenAIClient:
    def __init__(self, cfg: ClientConfig, count_tokens: Callable[[str], int] | None) -> None:
        self.cfg = cfg
        self.count_tokens = count_tokens
        headers = {"Authorization": f"Bearer {cfg.api_key}"} if cfg.api_key else {}
        self.http = httpx.AsyncClient(
            base_url=cfg.base_url,
            headers=headers,
            timeout=httpx.Timeout(cfg.timeout_s, connect=30.0),
            limits=httpx.Limits(max_connections=None, max_keepalive_connections=None),
        )
        self.path = "/chat/completions" if cfg.endpoint == "chat" else "/completions"

    async def aclose(self) -> None:
        await self.http.aclose()

    def body(self, payload: dict[str, Any], max_tokens: int) -> dict[str, Any]:
        body: dict[str, Any] = {"model": self.cfg.model, **payload, "max_tokens": max_tokens}
        if self.cfg.stream:
            body["stream"] = True
            body["stream_options"] = {"include_usage": True}
        if self.cfg.fixed_osl:
            body["ignore_eos"] = True
            body["min_tokens"] = max_tokens
        body.update(self.cfg.extra_body)
        return body

    async def send(self, record: RequestRecord, payload: dict[str, Any], max_tokens: int, t0: float) -> None:
        """Send one request and fill `record` in (times relative to t0). Never raises for request errors."""
        body = self.body(payload, max_tokens)
        record.requested_osl = max_tokens
        usage: dict[str, Any] = {}
        text_parts: list[str] = []
        record.t_send = time.perf_counter() - t0
        try:
            async with self.http.stream("POST", self.path, json=body) as resp:
                if resp.status_code >= 400:
                    raw = await resp.aread()
                    record.t_end = None
                    record.error = f"http_{resp.status_code}"
                    record.error_detail = _error_message(raw)
                    return
                if self.cfg.stream:
                    done = await self._read_stream(resp, record, text_parts, usage, t0)
                    if not done and record.error is None:
                        record.error = "incomplete"
                        record.error_detail = "the stream ended without [DONE]"
                        return
                else:
                    raw = await resp.aread()
                    record.t_end = time.perf_counter() - t0
                    obj = json.loads(raw)
                    usage.update(obj.get("usage") or {})
                    text_parts.append(_choice_text(obj, stream=False))
        except httpx.TimeoutException as e:
            record.error, record.error_detail = "timeout", str(e) or type(e).__name__
        except httpx.ConnectError as e:
            record.error, record.error_detail = "connect", str(e) or type(e).__name__
        except (httpx.RemoteProtocolError, httpx.ReadError) as e:
            record.error, record.error_detail = "disconnected", str(e) or type(e).__name__
        except (json.JSONDecodeError, UnicodeDecodeError, KeyError, TypeError, AttributeError) as e:
            record.error, record.error_detail = "bad_response", f"{type(e).__name__}: {e}"
        except httpx.HTTPError as e:
            record.error, record.error_detail = "http_error", f"{type(e).__name__}: {e}"
        except asyncio.CancelledError:
            record.error, record.error_detail = "cancelled", "still running when the duration and grace ended"
            record.t_end = None
            raise
        if record.error is not None:
            record.t_end = None
            return
        text = "".join(text_parts)
        record.output_text = text
        if isinstance(usage.get("completion_tokens"), int):
            record.osl, record.osl_source = usage["completion_tokens"], "usage"
        elif self.count_tokens is not None:
            record.osl, record.osl_source = self.count_tokens(text), "tokenizer"
        else:
            record.osl, record.osl_source = len(record.chunk_times), "chunks"
        if isinstance(usage.get("prompt_tokens"), int):
            record.isl = usage["prompt_tokens"]

    async def _read_stream(
        self,
        resp: httpx.Response,
        record: RequestRecord,
        text_parts: list[str],
        usage: dict[str, Any],
        t0: float,
    ) -> bool:
        """Read server-sent events; return whether [DONE] arrived."""
        buf = b""
        async for piece in resp.aiter_raw():
            now = time.perf_counter() - t0
            buf += piece
            if b"\n\n" not in buf and b"\r\n\r\n" not in buf:
                continue
            buf = buf.replace(b"\r\n", b"\n")
            *events, buf = buf.split(b"\n\n")
            for event in events:
                for line in event.split(b"\n"):
                    if not line.startswith(b"data:"):
                        continue
                    data = line[5:].strip()
                    if data == b"[DONE]":
                        record.t_end = now
                        return True
                    obj = json.loads(data)
                    if "error" in obj and not obj.get("choices"):
                        record.error = "stream_error"
                        record.error_detail = _error_message(data)
                        return False
                    if obj.get("usage"):
                        usage.update(obj["usage"])
                    text = _choice_text(obj, stream=True)
                    if text:
                        record.chunk_times.append(now)
                        text_parts.append(text)
                    record.t_end = now
        return False


def _choice_text(obj: dict[str, Any], stream: bool) -> str:
    choices = obj.get("choices") or []
    if not choices:
        return ""
    c = choices[0]
    if "text" in c:  # completions
        return c.get("text") or ""
    msg = c.get("delta" if stream else "message") or {}
    return (msg.get("content") or "") + (msg.get("reasoning_content") or "")


def _error_message(raw: bytes) -> str:
    try:
        obj = json.loads(raw)
        err = obj.get("error", obj)
        msg = err.get("message") if isinstance(err, dict) else err
        return str(msg or obj)[:500]
    except (json.JSONDecodeError, AttributeError, UnicodeDecodeError):
        return raw[:500].decode("utf-8", "replace")
