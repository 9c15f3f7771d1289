"""Decoupled models, streaming and the LLM through KServe v2, with Triton's own clients.

A `repeat` model answers each value of its input as a separate response, from a thread of its own
after execute() has returned (or raises part-way when asked); a BLS model sums them through
`exec(decoupled=True)`; the LLM is reached through `generate`, `generate_stream`, gRPC
ModelStreamInfer and an ensemble of tokenize -> LLM -> detokenize, each checked against the same
server's OpenAI completion for the same greedy request (the protocol adds nothing to the numbers).
"""

from __future__ import annotations

import json
import queue
import textwrap
from pathlib import Path

import httpx
import numpy as np
import pytest
from server_fixture import free_port, running_server

tritonclient_http = pytest.importorskip("tritonclient.http", reason="tritonclient is a dev dependency")
import tritonclient.grpc as grpcclient  # noqa: E402
from tritonclient.utils import InferenceServerException  # noqa: E402

REPEAT = """
import threading, time
import numpy as np
import triton_python_backend_utils as pb_utils

class TritonPythonModel:
    def execute(self, requests):
        for request in requests:
            values = pb_utils.get_input_tensor_by_name(request, "IN").as_numpy()
            fail = pb_utils.get_input_tensor_by_name(request, "FAIL_AT")
            sender = request.get_response_sender()
            if fail is not None:  # sent here, in execute(), until it raises part-way
                at = int(fail.as_numpy()[0])
                for i, v in enumerate(values):
                    if i == at:
                        raise ValueError(f"asked to fail at {at}")
                    sender.send(pb_utils.InferenceResponse([pb_utils.Tensor("OUT", np.array([v], np.int32))]))
                sender.send(flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
                continue
            threading.Thread(target=self._answer, args=(sender, values)).start()
        return None

    def _answer(self, sender, values):
        for v in values:
            time.sleep(0.01)
            sender.send(pb_utils.InferenceResponse([pb_utils.Tensor("OUT", np.array([v], np.int32))]))
        sender.send(flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
"""
REPEAT_CONFIG = """
name: "repeat"
backend: "python"
max_batch_size: 0
input [ { name: "IN" data_type: TYPE_INT32 dims: [ -1 ] },
        { name: "FAIL_AT" data_type: TYPE_INT32 dims: [ 1 ] optional: true } ]
output [ { name: "OUT" data_type: TYPE_INT32 dims: [ 1 ] } ]
model_transaction_policy { decoupled: true }
instance_group [ { count: 1 kind: KIND_CPU } ]
"""
SUM = """
import numpy as np
import triton_python_backend_utils as pb_utils

class TritonPythonModel:
    def execute(self, requests):
        out = []
        for request in requests:
            call = pb_utils.InferenceRequest(model_name="repeat", requested_output_names=["OUT"],
                                             inputs=[pb_utils.get_input_tensor_by_name(request, "IN")])
            total, seen = 0, 0
            for response in call.exec(decoupled=True):
                if response.has_error():
                    raise pb_utils.TritonModelException(response.error().message())
                if response.output_tensors():
                    total += int(pb_utils.get_output_tensor_by_name(response, "OUT").as_numpy()[0])
                    seen += 1
            sums = pb_utils.Tensor("SUM", np.array([total, seen], np.int32))
            out.append(pb_utils.InferenceResponse([sums]))
        return out
"""
SUM_CONFIG = """
name: "repeat_sum"
backend: "python"
max_batch_size: 0
input [ { name: "IN" data_type: TYPE_INT32 dims: [ -1 ] } ]
output [ { name: "SUM" data_type: TYPE_INT32 dims: [ 2 ] } ]
"""
# A TensorRT-LLM style pipeline around the server's LLM: the repository's own tokenizer steps.
TOKENIZE = """
import json
import numpy as np
import triton_python_backend_utils as pb_utils
from tokenizers import Tokenizer

class TritonPythonModel:
    def initialize(self, args):
        params = json.loads(args["model_config"])["parameters"]
        self.tok = Tokenizer.from_file(params["tokenizer"]["string_value"])

    def execute(self, requests):
        out = []
        for request in requests:
            text = pb_utils.get_input_tensor_by_name(request, "QUERY").as_numpy().reshape(-1)[0].decode()
            ids = self.tok.encode(text, add_special_tokens=False).ids
            out.append(pb_utils.InferenceResponse([
                pb_utils.Tensor("INPUT_ID", np.array([ids], np.int32)),
                pb_utils.Tensor("MAX_TOKENS", np.array([[8]], np.int32)),
                pb_utils.Tensor("TEMPERATURE", np.array([[0.0]], np.float32)),
            ]))
        return out
"""
DETOKENIZE = """
import json
import numpy as np
import triton_python_backend_utils as pb_utils
from tokenizers import Tokenizer

class TritonPythonModel:
    def initialize(self, args):
        params = json.loads(args["model_config"])["parameters"]
        self.tok = Tokenizer.from_file(params["tokenizer"]["string_value"])

    def execute(self, requests):
        out = []
        for request in requests:
            ids = pb_utils.get_input_tensor_by_name(request, "TOKENS").as_numpy().reshape(-1).tolist()
            text = self.tok.decode(ids, skip_special_tokens=True)
            answer = pb_utils.Tensor("ANSWER", np.array([[text.encode()]], object))
            out.append(pb_utils.InferenceResponse([answer]))
        return out
"""
PIPELINE_CONFIGS = {
    "tokenize": """
name: "tokenize"
backend: "python"
max_batch_size: 1
input [ { name: "QUERY" data_type: TYPE_STRING dims: [ 1 ] } ]
output [ { name: "INPUT_ID" data_type: TYPE_INT32 dims: [ -1 ] },
         { name: "MAX_TOKENS" data_type: TYPE_INT32 dims: [ 1 ] },
         { name: "TEMPERATURE" data_type: TYPE_FP32 dims: [ 1 ] } ]
parameters { key: "tokenizer" value: { string_value: "TOKENIZER" } }
""",
    "detokenize": """
name: "detokenize"
backend: "python"
max_batch_size: 1
input [ { name: "TOKENS" data_type: TYPE_INT32 dims: [ -1 ] } ]
output [ { name: "ANSWER" data_type: TYPE_STRING dims: [ 1 ] } ]
parameters { key: "tokenizer" value: { string_value: "TOKENIZER" } }
""",
    "llm_pipeline": """
name: "llm_pipeline"
platform: "ensemble"
max_batch_size: 1
input [ { name: "QUERY" data_type: TYPE_STRING dims: [ 1 ] } ]
output [ { name: "ANSWER" data_type: TYPE_STRING dims: [ 1 ] } ]
ensemble_scheduling { step [
  { model_name: "tokenize" input_map { key: "QUERY" value: "QUERY" }
    output_map [ { key: "INPUT_ID" value: "ids" }, { key: "MAX_TOKENS" value: "max_tokens" },
                 { key: "TEMPERATURE" value: "temperature" } ] },
  { model_name: "LLM"
    input_map [ { key: "input_ids" value: "ids" }, { key: "max_tokens" value: "max_tokens" },
                { key: "temperature" value: "temperature" } ]
    output_map { key: "output_ids" value: "tokens" } },
  { model_name: "detokenize" input_map { key: "TOKENS" value: "tokens" }
    output_map { key: "ANSWER" value: "ANSWER" } }
] }
""",
    # The same, streaming: each response of the LLM runs the detokenize step (Triton's way).
    "llm_stream_pipeline": """
name: "llm_stream_pipeline"
platform: "ensemble"
max_batch_size: 1
input [ { name: "QUERY" data_type: TYPE_STRING dims: [ 1 ] },
        { name: "STREAM" data_type: TYPE_BOOL dims: [ 1 ] } ]
output [ { name: "ANSWER" data_type: TYPE_STRING dims: [ 1 ] } ]
ensemble_scheduling { step [
  { model_name: "tokenize" input_map { key: "QUERY" value: "QUERY" }
    output_map [ { key: "INPUT_ID" value: "ids" }, { key: "MAX_TOKENS" value: "max_tokens" },
                 { key: "TEMPERATURE" value: "temperature" } ] },
  { model_name: "LLM"
    input_map [ { key: "input_ids" value: "ids" }, { key: "max_tokens" value: "max_tokens" },
                { key: "temperature" value: "temperature" }, { key: "stream" value: "STREAM" } ]
    output_map { key: "output_ids" value: "tokens" } },
  { model_name: "detokenize" input_map { key: "TOKENS" value: "tokens" }
    output_map { key: "ANSWER" value: "ANSWER" } }
] }
""",
}
LLM = "smollm2-135m"  # the served name of the embedded model
PROMPT = "The capital of France is"


def _write(root: Path, name: str, config: str, model: str | None) -> None:
    (root / name / "1").mkdir(parents=True)
    (root / name / "config.pbtxt").write_text(textwrap.dedent(config))
    if model is not None:
        (root / name / "1" / "model.py").write_text(model)


@pytest.fixture(scope="module")
def server(tmp_path_factory, model_path: Path, hf_model):
    from lora_adapters import SPECS, make_adapter

    root = tmp_path_factory.mktemp("decoupled")
    adapter = tmp_path_factory.mktemp("lora") / "all16"
    make_adapter(hf_model, SPECS[0], adapter)  # a LoRA adapter: a model of the repository too
    _write(root, "repeat", REPEAT_CONFIG, REPEAT)
    _write(root, "repeat_sum", SUM_CONFIG, SUM)
    from tokenmill.weights.tokenizer_source import load_tokenizer

    # The embedded model's tokenizer as the files a repository's Python steps load (tokenizer.json).
    load_tokenizer(model_path, None).save(root / "tokenizer")
    tokenizer = str(root / "tokenizer" / "tokenizer.json")
    for name, cfg in PIPELINE_CONFIGS.items():
        code = {"tokenize": TOKENIZE, "detokenize": DETOKENIZE}.get(name)  # (the ensembles have none)
        _write(root, name, cfg.replace("TOKENIZER", tokenizer).replace('"LLM"', f'"{LLM}"'), code)
    grpc_port = free_port()
    with running_server(
        "--model-repository", str(root), "--grpc-port", str(grpc_port), "--dtype", "float32",
        "--lora-modules", f"all16={adapter}", "--enable-lora-runtime-updating",
    ) as proc:  # fmt: skip
        proc.grpc_url = f"127.0.0.1:{grpc_port}"
        yield proc


def _stream(url: str, model: str, inputs: list, count: int | None = None, empty_final: bool = True) -> list:
    """The callbacks of one streamed request, (result, error) pairs: `count` of them (and then none
    more once the stream is closed), else until its final response (the FINAL flag sent alone reaches
    the client only with `empty_final`)."""
    got: queue.Queue = queue.Queue()
    client = grpcclient.InferenceServerClient(url)
    client.start_stream(callback=lambda result, error: got.put((result, error)))
    try:
        client.async_stream_infer(model, inputs, request_id="s1", enable_empty_final_response=empty_final)
        items = []
        while True:
            result, error = got.get(timeout=60)
            items.append((result, error))
            if error is not None or len(items) == count:
                break
            if count is None and result.get_response().parameters["triton_final_response"].bool_param:
                break
    finally:
        client.stop_stream()  # half-closes the stream and waits for the server to end it
        client.close()
    assert got.empty(), f"more responses than expected: {[got.get() for _ in range(got.qsize())]}"
    return items


def _int_input(grpc: bool, name: str, values: list[int]):
    mod = grpcclient if grpc else tritonclient_http
    t = mod.InferInput(name, [len(values)], "INT32")
    t.set_data_from_numpy(np.array(values, np.int32))
    return t


def test_grpc_stream_of_a_decoupled_model(server) -> None:
    values = [3, 1, 4, 1, 5]
    # The model sends the FINAL flag alone: without asking for it the client sees only the values,
    # none of them marked final.
    items = _stream(server.grpc_url, "repeat", [_int_input(True, "IN", values)], len(values), False)
    assert all(e is None for _, e in items)
    assert [int(r.as_numpy("OUT")[0]) for r, _ in items] == values
    assert [r.get_response().id for r, _ in items] == ["s1"] * len(values)
    assert not any(r.get_response().parameters["triton_final_response"].bool_param for r, _ in items)
    # Asked for, it arrives as an empty last response.
    items = _stream(server.grpc_url, "repeat", [_int_input(True, "IN", [7, 8])])
    assert [int(r.as_numpy("OUT")[0]) for r, _ in items[:2]] == [7, 8]
    last = items[-1][0].get_response()
    assert len(items) == 3 and not last.outputs and last.parameters["triton_final_response"].bool_param


def test_a_model_that_raises_mid_stream_ends_that_stream_and_keeps_serving(server) -> None:
    fail = grpcclient.InferInput("FAIL_AT", [1], "INT32")
    fail.set_data_from_numpy(np.array([2], np.int32))
    items = _stream(server.grpc_url, "repeat", [_int_input(True, "IN", [10, 20, 30]), fail])
    assert [int(r.as_numpy("OUT")[0]) for r, e in items if e is None] == [10, 20]
    assert items[-1][1] is not None and "asked to fail at 2" in str(items[-1][1])
    items = _stream(server.grpc_url, "repeat", [_int_input(True, "IN", [1, 2])], 2, empty_final=False)
    assert [int(r.as_numpy("OUT")[0]) for r, _ in items] == [1, 2]


def test_many_requests_on_one_stream_are_matched_by_id(server) -> None:
    got: queue.Queue = queue.Queue()
    client = grpcclient.InferenceServerClient(server.grpc_url)
    client.start_stream(callback=lambda result, error: got.put((result, error)))
    try:
        for k in range(4):
            client.async_stream_infer("repeat", [_int_input(True, "IN", [k] * (k + 1))], request_id=f"r{k}")
        seen: dict[str, list[int]] = {}
        for _ in range(sum(k + 1 for k in range(4))):
            result, error = got.get(timeout=60)
            assert error is None
            seen.setdefault(result.get_response().id, []).append(int(result.as_numpy("OUT")[0]))
    finally:
        client.stop_stream()
        client.close()
    assert seen == {f"r{k}": [k] * (k + 1) for k in range(4)}


def test_the_asyncio_clients_stream_and_infer(server) -> None:
    """tritonclient's asyncio clients: gRPC stream_infer over a decoupled model, HTTP infer on one that
    answers once."""
    import asyncio

    import tritonclient.grpc.aio as grpc_aio
    import tritonclient.http.aio as http_aio

    async def run() -> tuple[list[int], list[int]]:
        client = grpc_aio.InferenceServerClient(server.grpc_url)
        inp = _int_input(True, "IN", [4, 5, 6])

        async def requests():
            yield {"model_name": "repeat", "inputs": [inp], "request_id": "a1"}

        got = []
        try:
            async for result, error in client.stream_infer(requests()):
                assert error is None
                got.append(int(result.as_numpy("OUT")[0]))
                if len(got) == 3:
                    break
        finally:
            await client.close()
        hclient = http_aio.InferenceServerClient(server.base_url.removeprefix("http://"))
        try:
            one = await hclient.infer("repeat", [_int_input(False, "IN", [8])])
        finally:
            await hclient.close()
        return got, one.as_numpy("OUT").tolist()

    streamed, once = asyncio.run(run())
    assert streamed == [4, 5, 6] and once == [8]


def _sse(response: httpx.Response) -> list[dict]:
    return [json.loads(line[6:]) for line in response.text.splitlines() if line.startswith("data: ")]


def test_generate_stream_and_infer_on_a_decoupled_model(server) -> None:
    r = httpx.post(f"{server.base_url}/v2/models/repeat/generate_stream", json={"IN": [5, 6, 7]}, timeout=60)
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
    assert [e["OUT"] for e in _sse(r)] == [5, 6, 7]
    # Asking for one answer works when the model sends one; otherwise a clear 400.
    client = tritonclient_http.InferenceServerClient(server.base_url.removeprefix("http://"))
    assert client.infer("repeat", [_int_input(False, "IN", [9])]).as_numpy("OUT").tolist() == [9]
    with pytest.raises(InferenceServerException, match="sent 2 responses"):
        client.infer("repeat", [_int_input(False, "IN", [1, 2])])
    # A failure after the first response arrives as an error event.
    r = httpx.post(
        f"{server.base_url}/v2/models/repeat/generate_stream",
        json={"IN": [1, 2, 3], "FAIL_AT": 1},
        timeout=60,
    )
    events = _sse(r)
    assert events[0]["OUT"] == 1 and "asked to fail at 1" in events[-1]["error"]


def test_decoupled_bls_iterates_the_responses(server) -> None:
    client = tritonclient_http.InferenceServerClient(server.base_url.removeprefix("http://"))
    out = client.infer("repeat_sum", [_int_input(False, "IN", [2, 3, 4])]).as_numpy("SUM")
    assert out.tolist() == [9, 3]


def _reference(server, max_tokens: int = 8, model: str = LLM) -> str:
    body = {"model": model, "prompt": PROMPT, "max_tokens": max_tokens, "temperature": 0}
    r = httpx.post(f"{server.base_url}/v1/completions", json=body, timeout=120)
    return r.json()["choices"][0]["text"]


def test_the_llm_is_a_model_of_the_repository(server) -> None:
    client = tritonclient_http.InferenceServerClient(server.base_url.removeprefix("http://"))
    index = {m["name"]: m for m in client.get_model_repository_index()}
    assert index[LLM]["state"] == "READY"
    cfg = client.get_model_config(LLM)
    assert cfg["model_transaction_policy"]["decoupled"] is True
    assert {"text_input", "max_tokens", "stream"} <= {t["name"] for t in cfg["input"]}
    gcfg = grpcclient.InferenceServerClient(server.grpc_url).get_model_config(LLM, as_json=True)
    assert gcfg["config"]["name"] == LLM


def test_generate_and_generate_stream_match_the_openai_completion(server) -> None:
    want = _reference(server)
    body = {"text_input": PROMPT, "max_tokens": 8, "temperature": 0.0}
    r = httpx.post(f"{server.base_url}/v2/models/{LLM}/generate", json=body, timeout=120)
    assert r.status_code == 200, r.text
    assert r.json()["text_output"] == want and r.json()["model_name"] == LLM
    r = httpx.post(
        f"{server.base_url}/v2/models/{LLM}/generate_stream", json=body | {"stream": True}, timeout=120
    )
    events = _sse(r)
    assert len(events) > 1 and "".join(e["text_output"] for e in events) == want
    assert events[-1]["finish_reason"] == "length"


def test_a_lora_adapter_is_a_model_too_while_it_is_served(server) -> None:
    client = tritonclient_http.InferenceServerClient(server.base_url.removeprefix("http://"))
    assert {m["name"]: m["state"] for m in client.get_model_repository_index()}["all16"] == "READY"
    want = _reference(server, 16, model="all16")
    assert want != _reference(server, 16)  # the adapter changes what the model says
    body = {"text_input": PROMPT, "max_tokens": 16, "temperature": 0.0}
    r = httpx.post(f"{server.base_url}/v2/models/all16/generate", json=body, timeout=120)
    assert r.status_code == 200 and r.json()["text_output"] == want, r.text
    # Unloaded through the OpenAI-side route, it leaves the repository too.
    u = httpx.post(f"{server.base_url}/v1/unload_lora_adapter", json={"lora_name": "all16"})
    assert u.status_code == 200, u.text
    assert "all16" not in {m["name"] for m in client.get_model_repository_index()}
    r = httpx.post(f"{server.base_url}/v2/models/all16/generate", json=body, timeout=60)
    assert r.status_code == 404


def test_grpc_stream_of_the_llm(server) -> None:
    want = _reference(server)
    text = grpcclient.InferInput("text_input", [1, 1], "BYTES")
    text.set_data_from_numpy(np.array([[PROMPT.encode()]], dtype=object))
    inputs = [text]
    for name, dt, v in (("max_tokens", "INT32", np.int32(8)), ("temperature", "FP32", np.float32(0)),
                        ("stream", "BOOL", True)):  # fmt: skip
        t = grpcclient.InferInput(name, [1, 1], dt)
        t.set_data_from_numpy(
            np.array([[v]], dtype={"INT32": np.int32, "FP32": np.float32, "BOOL": bool}[dt])
        )
        inputs.append(t)
    items = _stream(server.grpc_url, LLM, inputs)
    assert all(e is None for _, e in items)
    pieces = [r.as_numpy("text_output").reshape(-1)[0].decode() for r, _ in items if r.get_response().outputs]
    assert len(pieces) > 1 and "".join(pieces) == want


def test_an_ensemble_tokenizes_runs_the_llm_and_detokenizes(server) -> None:
    want = _reference(server)
    client = tritonclient_http.InferenceServerClient(server.base_url.removeprefix("http://"))
    q = tritonclient_http.InferInput("QUERY", [1, 1], "BYTES")
    q.set_data_from_numpy(np.array([[PROMPT.encode()]], dtype=object))
    got = client.infer("llm_pipeline", [q]).as_numpy("ANSWER").reshape(-1)[0].decode()
    # The pipeline detokenizes the ids alone: the same text as the completion, but for the leading
    # space a tokenizer may attach to the first token.
    assert got.strip() == want.strip() and got


def test_an_ensemble_streams_through_the_llm(server) -> None:
    want = _reference(server)
    url = f"{server.base_url}/v2/models/llm_stream_pipeline/generate_stream"
    events = _sse(httpx.post(url, json={"QUERY": PROMPT, "STREAM": True}, timeout=120))
    assert len(events) > 1 and all("error" not in e for e in events), events
    assert "".join(e["ANSWER"] for e in events).strip() == want.strip()
    # The same ensemble without streaming answers once, through generate.
    r = httpx.post(
        url.replace("generate_stream", "generate"), json={"QUERY": PROMPT, "STREAM": False}, timeout=120
    )
    assert r.status_code == 200 and r.json()["ANSWER"].strip() == want.strip(), r.text


@pytest.mark.parametrize(
    ("body", "match"),
    [
        ({"max_tokens": 4}, "needs text_input or input_ids"),
        ({"text_input": PROMPT, "max_tokens": 10**6}, "context"),
        ({"text_input": PROMPT, "temperature": "hot"}, "FP32"),
        ({"text_input": PROMPT, "nonsense": {"a": 1}}, "neither an input"),
        ({"text_input": PROMPT, "stream": "false"}, "not a BOOL value"),
        ({"text_input": PROMPT, "max_tokens": 3.5}, "not a INT32 value"),
        # 1e400 is infinity to a JSON parser (a body written out, since httpx refuses to encode it)
        ('{"text_input": "hi", "parameters": {"max_tokens": 1e400}}', "not a number"),
        ('{"text_input": "hi", "parameters": {"priority": 1e400}}', "must be integers"),
    ],
)
def test_bad_generate_requests_get_a_400(server, body: dict | str, match: str) -> None:
    for route in ("generate", "generate_stream"):
        url = f"{server.base_url}/v2/models/{LLM}/{route}"
        r = httpx.post(url, content=body, timeout=60) if isinstance(body, str) else httpx.post(url, json=body)
        assert r.status_code == 400 and match in r.json()["error"], (route, r.text)


def test_unknown_models_say_so_on_both_protocols(server) -> None:
    r = httpx.post(f"{server.base_url}/v2/models/nope/generate", json={"text_input": "x"})
    assert r.status_code == 404 and "unknown model" in r.json()["error"]
    items = _stream(server.grpc_url, "nope", [_int_input(True, "IN", [1])])
    assert items[-1][1] is not None and "unknown model" in str(items[-1][1])


def test_sender_refuses_a_response_after_the_final_flag() -> None:
    import asyncio

    from tokenmill.triton import pb_utils
    from tokenmill.triton.decoupled import ResponseStream

    async def run() -> list:
        stream = ResponseStream(asyncio.get_running_loop())
        sender = pb_utils.InferenceResponseSender(stream.send, lambda: stream.cancelled)
        sender.send(pb_utils.InferenceResponse([pb_utils.Tensor("A", np.zeros(1))]))
        sender.send(flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
        with pytest.raises(pb_utils.TritonModelException, match="FINAL flag was already sent"):
            sender.send(pb_utils.InferenceResponse([]))
        with pytest.raises(pb_utils.TritonModelException, match="needs a response"):
            sender.send()
        return [i async for i in stream]

    items = asyncio.run(run())
    assert len(items) == 2 and items[1].final and items[1].outputs is None
