"""OpenTelemetry traces across processes, received by a real OTLP/HTTP receiver started here.

The receiver decodes each export with OpenTelemetry's own protobuf classes (ExportTraceServiceRequest),
as a collector does; the tests then follow the parent links from the client's traceparent through the
HTTP front (and a fleet's router) to the engine span in another process, and its phase children.
"""

from __future__ import annotations

import gzip
import secrets
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import httpx
import pytest

pytest.importorskip("opentelemetry.sdk", reason="the tracing extra is not installed")
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (  # noqa: E402
    ExportTraceServiceRequest,
    ExportTraceServiceResponse,
)
from server_fixture import running_server  # noqa: E402

from tokenmill.tracing import clean_carrier  # noqa: E402

# A bit over 512 tokens: long enough that a 1P1D fleet prefills it on its prefill worker.
LONG = "A worker keeps the keys and values of every token it has seen in its cache. " * 40
SLACK_NS = 2_000_000  # children's ends are stamped by separate clock reads: 2 ms of slack


class Receiver:
    """An OTLP/HTTP trace receiver on 127.0.0.1: every span of every export, with its resource's
    attributes, as plain dicts."""

    def __init__(self) -> None:
        self.spans: list[dict] = []
        self.lock = threading.Lock()
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:  # noqa: N802 - the http.server API
                body = self.rfile.read(int(self.headers["Content-Length"]))
                if self.headers.get("Content-Encoding") == "gzip":
                    body = gzip.decompress(body)
                ok = (
                    self.path == "/v1/traces" and self.headers.get("Content-Type") == "application/x-protobuf"
                )
                if ok:
                    receiver.take(ExportTraceServiceRequest.FromString(body))
                reply = ExportTraceServiceResponse().SerializeToString()
                self.send_response(200 if ok else 400)
                self.send_header("Content-Type", "application/x-protobuf")
                self.send_header("Content-Length", str(len(reply)))
                self.end_headers()
                self.wfile.write(reply)

            def log_message(self, *args: object) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/v1/traces"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def take(self, export: ExportTraceServiceRequest) -> None:
        for rs in export.resource_spans:
            resource = {a.key: _value(a.value) for a in rs.resource.attributes}
            for ss in rs.scope_spans:
                for s in ss.spans:
                    span = {
                        "name": s.name,
                        "trace_id": s.trace_id.hex(),
                        "span_id": s.span_id.hex(),
                        "parent": s.parent_span_id.hex(),
                        "start": s.start_time_unix_nano,
                        "end": s.end_time_unix_nano,
                        "attributes": {a.key: _value(a.value) for a in s.attributes},
                        "resource": resource,
                    }
                    with self.lock:
                        self.spans.append(span)

    def trace(self, trace_id: str) -> list[dict]:
        with self.lock:
            return [s for s in self.spans if s["trace_id"] == trace_id]

    def wait(self, trace_id: str, names: dict[str, int], timeout: float = 30.0) -> list[dict]:
        """The trace's spans once it holds at least `names[n]` spans named n."""
        deadline = time.monotonic() + timeout
        while True:
            spans = self.trace(trace_id)
            have = {n: sum(s["name"] == n for s in spans) for n in names}
            if all(have[n] >= k for n, k in names.items()):
                return spans
            assert time.monotonic() < deadline, f"spans of {trace_id} after {timeout}s: {have}"
            time.sleep(0.1)

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


def _value(v) -> object:  # noqa: ANN001 - an OTLP AnyValue
    kind = v.WhichOneof("value")
    if kind == "array_value":
        return [_value(x) for x in v.array_value.values]
    return getattr(v, kind) if kind else None


def _traceparent() -> tuple[str, str, str]:
    trace_id, span_id = secrets.token_hex(16), secrets.token_hex(8)
    return f"00-{trace_id}-{span_id}-01", trace_id, span_id


def _one(spans: list[dict], name: str, **where: object) -> dict:
    found = [
        s for s in spans if s["name"] == name and all(s["attributes"].get(k) == v for k, v in where.items())
    ]
    assert len(found) == 1, (name, where, [(s["name"], s["attributes"]) for s in spans])
    return found[0]


def _check_engine_span(spans: list[dict], engine: dict, front: dict) -> None:
    """The engine span: in another process than the front, its phases as children inside it, in order."""
    assert engine["resource"]["tokenmill.role"] == "engine"
    assert engine["resource"]["process.pid"] != front["resource"]["process.pid"]
    kids = {s["name"]: s for s in spans if s["parent"] == engine["span_id"]}
    assert {"queue", "prefill", "decode"} <= set(kids), sorted(kids)
    for kid in kids.values():
        assert engine["start"] - SLACK_NS <= kid["start"] <= kid["end"] <= engine["end"] + SLACK_NS
    assert kids["queue"]["end"] <= kids["prefill"]["start"] + SLACK_NS
    assert kids["prefill"]["end"] <= kids["decode"]["start"] + SLACK_NS
    a = engine["attributes"]
    assert a["tokenmill.queue_time_s"] >= 0 and a["tokenmill.prefill_time_s"] > 0


def test_only_well_formed_trace_context_is_kept() -> None:
    """Clients and engine-protocol peers choose these values: W3C's forms pass, anything else is dropped
    before the SDK sees it."""
    parent = "00-" + "4bf92f3577b34da6a3ce929d0e0e4736" + "-" + "00f067aa0ba902b7" + "-01"
    assert clean_carrier({"traceparent": parent}) == {"traceparent": parent}
    state = "rojo=00f067aa0ba902b7, congo=t61rcWkgMzE"
    assert clean_carrier({"traceparent": parent, "tracestate": state, "x-other": "1"}) == {
        "traceparent": parent,
        "tracestate": "rojo=00f067aa0ba902b7,congo=t61rcWkgMzE",
    }
    for bad_state in ("BAD KEY=1", ",".join(f"k{i}=v" for i in range(33)), "a=" + "b" * 600, 7):
        assert clean_carrier({"traceparent": parent, "tracestate": bad_state}) == {"traceparent": parent}
    for bad in ("00-zz", parent.upper(), "ff" + parent[2:], parent + "-extra", "", None, 3):
        assert clean_carrier({"traceparent": bad, "tracestate": "a=b"}) is None, bad
    assert clean_carrier({"tracestate": "a=b"}) is None and clean_carrier(["traceparent"]) is None


@pytest.fixture
def receiver():
    r = Receiver()
    yield r
    r.close()


@pytest.fixture
def fast_export(monkeypatch: pytest.MonkeyPatch) -> None:
    # The SDK sends a batch every 5 s by default; the servers started here inherit a shorter delay.
    monkeypatch.setenv("OTEL_BSP_SCHEDULE_DELAY", "100")


@pytest.mark.slow
def test_a_request_is_one_trace_from_the_client_through_the_front_to_the_engine(
    receiver, fast_export
) -> None:
    with running_server("--otlp-traces-endpoint", receiver.url) as server:
        base = server.base_url
        header, trace_id, client_span = _traceparent()
        body = {"model": "smollm2-135m", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 8}
        r = httpx.post(f"{base}/v1/chat/completions", json=body, headers={"traceparent": header}, timeout=60)
        assert r.status_code == 200, r.text
        usage = r.json()["usage"]
        # A stream is traced until its last chunk.
        header2, trace2, _ = _traceparent()
        with httpx.stream(
            "POST", f"{base}/v1/completions", headers={"traceparent": header2}, timeout=60,
            json={"model": "smollm2-135m", "prompt": "Once upon", "max_tokens": 6, "stream": True},
        ) as s:  # fmt: skip
            assert s.status_code == 200
            chunks = [line for line in s.iter_lines() if line.startswith("data: {")]
        # n=2: two sequences, two engine spans, siblings under the one front span.
        header3, trace3, _ = _traceparent()
        two = {**body, "n": 2, "temperature": 1.0, "seed": 3}
        r = httpx.post(f"{base}/v1/chat/completions", json=two, headers={"traceparent": header3}, timeout=60)
        assert r.status_code == 200, r.text
        # Not traced: a probe of health. A malformed or oversized traceparent is ignored: the request is
        # answered and starts a trace of its own.
        assert httpx.get(f"{base}/health", timeout=10).status_code == 200
        for bad in ("00-zz-not-a-trace-01", "00-" + "a" * 2000):
            one = {**body, "max_tokens": 1, "user": bad[:20]}
            r = httpx.post(f"{base}/v1/chat/completions", json=one, headers={"traceparent": bad}, timeout=60)
            assert r.status_code == 200, r.text

        spans = receiver.wait(trace_id, {"POST /v1/chat/completions": 1, "llm_request": 1, "decode": 1})
        front = _one(spans, "POST /v1/chat/completions")
        assert front["parent"] == client_span, "the client's span is the front's parent"
        assert front["resource"]["tokenmill.role"] == "front"
        fa = front["attributes"]
        assert fa["http.response.status_code"] == 200
        assert fa["gen_ai.usage.input_tokens"] == usage["prompt_tokens"]
        assert fa["gen_ai.usage.output_tokens"] == usage["completion_tokens"]
        assert 0 < fa["gen_ai.latency.time_to_first_token"] <= fa["gen_ai.latency.e2e"]
        engine = _one(spans, "llm_request")
        assert engine["parent"] == front["span_id"], "the engine's span hangs from the front's"
        ea = engine["attributes"]
        assert ea["gen_ai.usage.input_tokens"] == usage["prompt_tokens"]
        assert ea["gen_ai.usage.output_tokens"] == usage["completion_tokens"]
        assert ea["gen_ai.response.finish_reasons"] == ["length"]
        _check_engine_span(spans, engine, front)
        assert front["start"] <= engine["start"] and engine["end"] <= front["end"] + SLACK_NS

        spans2 = receiver.wait(trace2, {"POST /v1/completions": 1, "llm_request": 1})
        stream_front = _one(spans2, "POST /v1/completions")
        assert stream_front["attributes"]["gen_ai.usage.output_tokens"] == 6 and len(chunks) >= 6
        assert _one(spans2, "llm_request")["parent"] == stream_front["span_id"]
        assert not [s for s in receiver.spans if s["attributes"].get("url.path") == "/health"]
        spans3 = receiver.wait(trace3, {"POST /v1/chat/completions": 1, "llm_request": 2})
        front3 = _one(spans3, "POST /v1/chat/completions")
        engines3 = [s for s in spans3 if s["name"] == "llm_request"]
        assert len(engines3) == 2 and all(s["parent"] == front3["span_id"] for s in engines3)
        assert front3["attributes"]["gen_ai.usage.output_tokens"] == sum(
            s["attributes"]["gen_ai.usage.output_tokens"] for s in engines3
        )
        deadline = time.monotonic() + 30
        while True:  # the two requests with bad headers: roots of new traces, each with its engine span
            with receiver.lock:
                roots = [
                    s for s in receiver.spans if s["name"] == "POST /v1/chat/completions" and not s["parent"]
                ]
                ids = {s["trace_id"] for s in roots}
                engines = [s for s in receiver.spans if s["name"] == "llm_request" and s["trace_id"] in ids]
            if len(roots) == 2 and len(engines) == 2:
                break
            assert time.monotonic() < deadline, (roots, engines)
            time.sleep(0.1)


@pytest.mark.slow
def test_a_disaggregated_fleet_traces_the_route_and_both_workers(receiver, fast_export) -> None:
    """1P1D behind the router: the front's span, a route span per worker the request visited, and each
    worker's engine span under its route; the decode worker's shows the blocks it read and the load."""
    args = ["--workers", "2", "--disaggregate", "1P1D", "--disagg-min-prefill-tokens", "256"]
    with running_server(*args, "--otlp-traces-endpoint", receiver.url, timeout=300) as server:
        header, trace_id, client_span = _traceparent()
        body = {"model": "smollm2-135m", "prompt": LONG, "max_tokens": 4, "temperature": 0}
        r = httpx.post(
            f"{server.base_url}/v1/completions", json=body, headers={"traceparent": header}, timeout=120
        )
        assert r.status_code == 200, r.text
        usage = r.json()["usage"]
        spans = receiver.wait(
            trace_id, {"POST /v1/completions": 1, "route": 2, "llm_request": 2, "kv_load": 1}
        )
        front = _one(spans, "POST /v1/completions")
        assert front["parent"] == client_span
        routes = {s["attributes"]["tokenmill.kv_role"]: s for s in spans if s["name"] == "route"}
        assert set(routes) == {"prefill", "decode"}
        engines = {}
        for role, route in routes.items():
            assert route["parent"] == front["span_id"]
            assert route["resource"]["process.pid"] == front["resource"]["process.pid"], (
                "the router is the front's"
            )
            assert route["attributes"]["tokenmill.worker"]
            engines[role] = _one(spans, "llm_request", **{"tokenmill.kv_role": role})
            assert engines[role]["parent"] == route["span_id"]
            _check_engine_span(spans, engines[role], front)
        assert engines["prefill"]["resource"]["process.pid"] != engines["decode"]["resource"]["process.pid"]
        decode = engines["decode"]["attributes"]
        assert decode["tokenmill.kv.loaded_blocks"] > 0, "the decode worker read the prompt's blocks"
        assert decode["gen_ai.usage.output_tokens"] == usage["completion_tokens"]
        load = _one(spans, "kv_load")
        assert load["parent"] == engines["decode"]["span_id"]


@pytest.mark.slow
def test_blocks_loaded_back_from_the_host_tier_are_in_the_engine_span(receiver, fast_export) -> None:
    """A prompt's blocks evicted to the host tier and loaded back for its second request: that
    request's engine span counts them (as the offload metric does), and its cached tokens."""
    small = ["--dtype", "float32", "--threads", "1", "--max-model-len", "512", "--kv-cache-memory-gb", "0.03"]
    prompt = "In the valley of the three rivers the harvest came late that year, and the mills " * 5
    with running_server(*small, "--kv-offload", "host=64MB", "--otlp-traces-endpoint", receiver.url) as srv:

        def send(text: str, header: str | None = None) -> dict:
            body = {"model": "smollm2-135m", "prompt": text, "max_tokens": 1}
            headers = {"traceparent": header} if header else {}
            r = httpx.post(f"{srv.base_url}/v1/completions", json=body, headers=headers, timeout=120)
            assert r.status_code == 200, r.text
            return r.json()["usage"]

        first = send(prompt)
        for i in range(12):  # prompts of ~8 blocks through a pool of ~40: the first one's are evicted
            send(f"Filler prompt number {i}, other words to push the pool's blocks out. " * 7)
        header, trace_id, _ = _traceparent()
        again = send(prompt, header)
        metrics = httpx.get(f"{srv.base_url}/metrics", timeout=10).text
    full = (first["prompt_tokens"] - 1) // 16
    assert again["prompt_tokens_details"]["cached_tokens"] == full * 16
    assert 'tier="host"' in metrics, "blocks came back from the host tier"
    engine = _one(receiver.wait(trace_id, {"llm_request": 1}), "llm_request")["attributes"]
    # Here all of them were evicted and come back (seen: `full`); the pool's eviction order decides that, so
    # the bound is what must hold anywhere: some came from the tier, none beyond the prompt's full blocks.
    assert 1 <= engine["tokenmill.kv.loaded_blocks"] <= full
    assert engine["tokenmill.kv.loaded_tokens"] == 16 * engine["tokenmill.kv.loaded_blocks"]
    assert engine["tokenmill.cached_tokens"] == full * 16
