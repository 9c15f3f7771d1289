"""A fake OpenAI-compatible server with known, deterministic timing, for testing load generators.

Every request streams max_tokens tokens: the first `first_token_ms` after the request arrives, then
one every `itl_ms`, each on an absolute schedule (no drift), then a usage chunk and [DONE]. Without
streaming, the whole answer comes at the time the last token would have. Every `fail_every`-th
request (if set) gets a 500 in the OpenAI error shape. Plain asyncio and hand-written HTTP/1.1 with
keep-alive, so that the server is never the bottleneck when measuring the client.

    python -m tokenmill.bench.fake_server --port 8100 --first-token-ms 50 --itl-ms 10
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import time

MODEL = "fake-model"


class FakeServer:
    def __init__(self, first_token_ms: float, itl_ms: float, fail_every: int = 0) -> None:
        self.first_s, self.itl_s, self.fail_every = first_token_ms / 1e3, itl_ms / 1e3, fail_every
        self.counter = itertools.count(1)

    async def handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                t_arrival = time.perf_counter()
                lines = head.decode("latin-1").split("\r\n")
                method, path, _ = lines[0].split(" ", 2)
                headers = {
                    k.strip().lower(): v.strip() for k, _, v in (ln.partition(":") for ln in lines[1:] if ln)
                }
                body = await reader.readexactly(int(headers.get("content-length", "0")))
                await self.respond(method, path, body, t_arrival, writer)
                if headers.get("connection", "").lower() == "close":
                    break
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            writer.close()

    async def respond(
        self, method: str, path: str, body: bytes, t0: float, writer: asyncio.StreamWriter
    ) -> None:
        if method == "GET" and path.endswith("/models"):
            return _send_json(writer, 200, {"object": "list", "data": [{"id": MODEL, "object": "model"}]})
        if method != "POST" or not path.endswith(("/chat/completions", "/completions")):
            return _send_json(writer, 404, {"error": {"message": f"no route {method} {path}", "code": 404}})
        if self.fail_every and next(self.counter) % self.fail_every == 0:
            return _send_json(writer, 500, {"error": {"message": "injected failure", "code": 500}})
        req = json.loads(body)
        chat = path.endswith("/chat/completions")
        n = int(req.get("max_tokens") or 16)
        prompt = req.get("prompt") if not chat else " ".join(m["content"] for m in req["messages"])
        usage = {
            "prompt_tokens": len(str(prompt).split()),
            "completion_tokens": n,
            "total_tokens": len(str(prompt).split()) + n,
        }
        if not req.get("stream"):
            await _sleep_until(t0 + self.first_s + (n - 1) * self.itl_s)
            text = " tok" * n
            choice = (
                {"index": 0, "message": {"role": "assistant", "content": text}}
                if chat
                else {"index": 0, "text": text}
            )
            return _send_json(writer, 200, {"choices": [choice], "usage": usage})
        writer.write(
            b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n"
        )
        for i in range(n):
            await _sleep_until(t0 + self.first_s + i * self.itl_s)
            piece = {"delta": {"content": " tok"}} if chat else {"text": " tok"}
            _send_chunk(writer, {"choices": [{"index": 0, **piece, "finish_reason": None}]})
            await writer.drain()
        _send_chunk(writer, {"choices": [], "usage": usage})
        writer.write(_chunked(b"data: [DONE]\n\n") + b"0\r\n\r\n")
        await writer.drain()


async def _sleep_until(t: float) -> None:
    delay = t - time.perf_counter()
    if delay > 0:
        await asyncio.sleep(delay)


def _chunked(data: bytes) -> bytes:
    return b"%x\r\n%s\r\n" % (len(data), data)


def _send_chunk(writer: asyncio.StreamWriter, obj: dict) -> None:
    writer.write(_chunked(b"data: " + json.dumps(obj).encode() + b"\n\n"))


def _send_json(writer: asyncio.StreamWriter, status: int, obj: dict) -> None:
    data = json.dumps(obj).encode()
    reason = {200: "OK", 404: "Not Found", 500: "Internal Server Error"}[status]
    head = (
        f"HTTP/1.1 {status} {reason}\r\ncontent-type: application/json\r\ncontent-length: {len(data)}\r\n\r\n"
    )
    writer.write(head.encode() + data)


async def serve(host: str, port: int, server: FakeServer, ready: asyncio.Future | None = None) -> None:
    srv = await asyncio.start_server(server.handle, host, port, backlog=4096)
    bound = srv.sockets[0].getsockname()[1]
    print(f"fake server on http://{host}:{bound}/v1", flush=True)
    if ready is not None:
        ready.set_result(bound)
    async with srv:
        await srv.serve_forever()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=0)
    ap.add_argument("--first-token-ms", type=float, default=50.0)
    ap.add_argument("--itl-ms", type=float, default=10.0)
    ap.add_argument("--fail-every", type=int, default=0)
    a = ap.parse_args()
    coro = serve(a.host, a.port, FakeServer(a.first_token_ms, a.itl_ms, a.fail_every))
    try:
        import uvloop

        uvloop.run(coro)
    except ImportError:
        asyncio.run(coro)


if __name__ == "__main__":
    main()
