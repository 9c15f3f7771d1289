"""A Triton + TensorRT-LLM repository, unchanged: `backend: "tensorrtllm"` served by the server's LLM.

The repository is laid out as TensorRT-LLM's inflight_batcher_llm one is: a `tensorrt_llm` model in
its tensors (input_ids, input_lengths, request_output_len, end_id, stop/bad word lists, streaming;
output_ids [batch, beam, len], sequence_length, log probs), Python pre- and post-processing around it,
and an ensemble of the three called through `generate`. Token ids and log probs are checked against
Hugging Face transformers' greedy continuation in float32; texts against the same server's OpenAI
completion. (The pre- and post-processing models are written here, in the shape of TensorRT-LLM's.)
"""

from __future__ import annotations

import json
import queue
from pathlib import Path

import httpx
import numpy as np
import pytest
from reference import hf_greedy
from server_fixture import free_port, running_server
from test_triton_decoupled import _write

tritonclient_http = pytest.importorskip("tritonclient.http", reason="tritonclient is a dev dependency")
import tritonclient.grpc as grpcclient  # noqa: E402

LLM = "smollm2-135m"
PROMPTS = ["The capital of France is", "One, two, three, four,"]
NEW = 8
LOGPROB_TOL = 2e-3  # float32 engine against float32 transformers (test_correctness_hf's bound)

# TensorRT-LLM's tensorrt_llm model, as its template declares it (engine parameters left unfilled:
# they name GPU engine files that are not read here).
TRTLLM = """
name: "NAME"
backend: "tensorrtllm"
max_batch_size: 4
model_transaction_policy { decoupled: DECOUPLED }
input [
  { name: "input_ids" data_type: TYPE_INT32 dims: [ -1 ] allow_ragged_batch: true },
  { name: "input_lengths" data_type: TYPE_INT32 dims: [ 1 ] reshape: { shape: [ ] } },
  { name: "request_output_len" data_type: TYPE_INT32 dims: [ 1 ] reshape: { shape: [ ] } },
  { name: "end_id" data_type: TYPE_INT32 dims: [ 1 ] reshape: { shape: [ ] } optional: true },
  { name: "pad_id" data_type: TYPE_INT32 dims: [ 1 ] reshape: { shape: [ ] } optional: true },
  { name: "stop_words_list" data_type: TYPE_INT32 dims: [ 2, -1 ] optional: true allow_ragged_batch: true },
  { name: "bad_words_list" data_type: TYPE_INT32 dims: [ 2, -1 ] optional: true allow_ragged_batch: true },
  { name: "embedding_bias" data_type: TYPE_FP32 dims: [ -1 ] optional: true allow_ragged_batch: true },
  { name: "beam_width" data_type: TYPE_INT32 dims: [ 1 ] reshape: { shape: [ ] } optional: true },
  { name: "temperature" data_type: TYPE_FP32 dims: [ 1 ] reshape: { shape: [ ] } optional: true },
  { name: "runtime_top_k" data_type: TYPE_INT32 dims: [ 1 ] reshape: { shape: [ ] } optional: true },
  { name: "runtime_top_p" data_type: TYPE_FP32 dims: [ 1 ] reshape: { shape: [ ] } optional: true },
  { name: "random_seed" data_type: TYPE_UINT64 dims: [ 1 ] reshape: { shape: [ ] } optional: true },
  { name: "return_log_probs" data_type: TYPE_BOOL dims: [ 1 ] reshape: { shape: [ ] } optional: true },
  { name: "streaming" data_type: TYPE_BOOL dims: [ 1 ] optional: true },
  { name: "lora_task_id" data_type: TYPE_UINT64 dims: [ 1 ] reshape: { shape: [ ] } optional: true }
]
output [
  { name: "output_ids" data_type: TYPE_INT32 dims: [ -1, -1 ] },
  { name: "sequence_length" data_type: TYPE_INT32 dims: [ -1 ] },
  { name: "cum_log_probs" data_type: TYPE_FP32 dims: [ -1 ] },
  { name: "output_log_probs" data_type: TYPE_FP32 dims: [ -1, -1 ] },
  { name: "context_logits" data_type: TYPE_FP32 dims: [ -1, -1 ] }
]
instance_group [ { count: 1 kind: KIND_CPU } ]
parameters { key: "gpt_model_type" value: { string_value: "inflight_fused_batching" } }
parameters { key: "gpt_model_path" value: { string_value: "${engine_dir}" } }
parameters { key: "exclude_input_in_output" value: { string_value: "EXCLUDE" } }
"""
# The pre- and post-processing models share their imports and their tokenizer's loading.
IMPORTS = """
import json
import numpy as np
import triton_python_backend_utils as pb_utils
from tokenizers import Tokenizer
"""
INIT = """
class TritonPythonModel:
    def initialize(self, args):
        params = json.loads(args["model_config"])["parameters"]
        self.tok = Tokenizer.from_file(params["tokenizer_dir"]["string_value"])
"""
PREPROCESS = (
    IMPORTS
    + """
def word_list(tok, texts):
    # TensorRT-LLM's [2, n] layout: the words' ids end to end, then each word's end offset (-1 padded).
    ids, ends = [], []
    for t in texts:
        for word in (w for w in t.decode().split(",") if w):
            ids += tok.encode(word, add_special_tokens=False).ids
            ends.append(len(ids))
    if not ids:
        return np.array([[[0], [-1]]], np.int32)
    return np.array([[ids, ends + [-1] * (len(ids) - len(ends))]], np.int32)

"""
    + INIT
    + """
    def execute(self, requests):
        out = []
        for r in requests:
            query = pb_utils.get_input_tensor_by_name(r, "QUERY").as_numpy().reshape(-1)[0].decode()
            ids = self.tok.encode(query, add_special_tokens=False).ids
            words = {}
            for name in ("STOP_WORDS_DICT", "BAD_WORDS_DICT"):
                t = pb_utils.get_input_tensor_by_name(r, name)
                words[name] = word_list(self.tok, [] if t is None else t.as_numpy().reshape(-1))
            out.append(pb_utils.InferenceResponse([
                pb_utils.Tensor("INPUT_ID", np.array([ids], np.int32)),
                pb_utils.Tensor("REQUEST_INPUT_LEN", np.array([[len(ids)]], np.int32)),
                pb_utils.Tensor("STOP_WORDS_IDS", words["STOP_WORDS_DICT"]),
                pb_utils.Tensor("BAD_WORDS_IDS", words["BAD_WORDS_DICT"]),
                pb_utils.Tensor("REQUEST_OUTPUT_LEN",
                                pb_utils.get_input_tensor_by_name(r, "REQUEST_OUTPUT_LEN").as_numpy()),
            ]))
        return out
"""
)
POSTPROCESS = (
    IMPORTS
    + INIT
    + """
    def execute(self, requests):
        out = []
        for r in requests:
            tokens = pb_utils.get_input_tensor_by_name(r, "TOKENS_BATCH").as_numpy()  # [batch, beam, len]
            lengths = pb_utils.get_input_tensor_by_name(r, "SEQUENCE_LENGTH").as_numpy()
            texts = [self.tok.decode(tokens[b][0][: lengths[b][0]].tolist(), skip_special_tokens=True)
                     .encode() for b in range(tokens.shape[0])]
            out.append(pb_utils.InferenceResponse([pb_utils.Tensor("OUTPUT", np.array(texts, object))]))
        return out
"""
)
CONFIGS = {
    "preprocessing": """
name: "preprocessing"
backend: "python"
max_batch_size: 4
input [ { name: "QUERY" data_type: TYPE_STRING dims: [ 1 ] },
        { name: "REQUEST_OUTPUT_LEN" data_type: TYPE_INT32 dims: [ 1 ] },
        { name: "BAD_WORDS_DICT" data_type: TYPE_STRING dims: [ -1 ] optional: true },
        { name: "STOP_WORDS_DICT" data_type: TYPE_STRING dims: [ -1 ] optional: true } ]
output [ { name: "INPUT_ID" data_type: TYPE_INT32 dims: [ -1 ] },
         { name: "REQUEST_INPUT_LEN" data_type: TYPE_INT32 dims: [ 1 ] },
         { name: "BAD_WORDS_IDS" data_type: TYPE_INT32 dims: [ 2, -1 ] },
         { name: "STOP_WORDS_IDS" data_type: TYPE_INT32 dims: [ 2, -1 ] },
         { name: "REQUEST_OUTPUT_LEN" data_type: TYPE_INT32 dims: [ -1 ] } ]
parameters { key: "tokenizer_dir" value: { string_value: "TOKENIZER" } }
""",
    "postprocessing": """
name: "postprocessing"
backend: "python"
max_batch_size: 4
input [ { name: "TOKENS_BATCH" data_type: TYPE_INT32 dims: [ -1, -1 ] },
        { name: "SEQUENCE_LENGTH" data_type: TYPE_INT32 dims: [ -1 ] } ]
output [ { name: "OUTPUT" data_type: TYPE_STRING dims: [ -1 ] } ]
parameters { key: "tokenizer_dir" value: { string_value: "TOKENIZER" } }
""",
    "ensemble": """
name: "ensemble"
platform: "ensemble"
max_batch_size: 4
input [ { name: "text_input" data_type: TYPE_STRING dims: [ 1 ] },
        { name: "max_tokens" data_type: TYPE_INT32 dims: [ 1 ] },
        { name: "bad_words" data_type: TYPE_STRING dims: [ -1 ] optional: true },
        { name: "stop_words" data_type: TYPE_STRING dims: [ -1 ] optional: true },
        { name: "end_id" data_type: TYPE_INT32 dims: [ 1 ] optional: true },
        { name: "temperature" data_type: TYPE_FP32 dims: [ 1 ] optional: true },
        { name: "stream" data_type: TYPE_BOOL dims: [ 1 ] optional: true } ]
output [ { name: "text_output" data_type: TYPE_STRING dims: [ -1 ] } ]
ensemble_scheduling { step [
  { model_name: "preprocessing" model_version: -1
    input_map [ { key: "QUERY" value: "text_input" }, { key: "REQUEST_OUTPUT_LEN" value: "max_tokens" },
                { key: "BAD_WORDS_DICT" value: "bad_words" }, { key: "STOP_WORDS_DICT" value: "stop_words" } ]
    output_map [ { key: "INPUT_ID" value: "_INPUT_ID" },
                 { key: "REQUEST_INPUT_LEN" value: "_REQUEST_INPUT_LEN" },
                 { key: "BAD_WORDS_IDS" value: "_BAD_WORDS_IDS" },
                 { key: "STOP_WORDS_IDS" value: "_STOP_WORDS_IDS" },
                 { key: "REQUEST_OUTPUT_LEN" value: "_REQUEST_OUTPUT_LEN" } ] },
  { model_name: "tensorrt_llm" model_version: -1
    input_map [ { key: "input_ids" value: "_INPUT_ID" }, { key: "input_lengths" value: "_REQUEST_INPUT_LEN" },
                { key: "request_output_len" value: "_REQUEST_OUTPUT_LEN" }, { key: "end_id" value: "end_id" },
                { key: "stop_words_list" value: "_STOP_WORDS_IDS" },
                { key: "bad_words_list" value: "_BAD_WORDS_IDS" },
                { key: "temperature" value: "temperature" }, { key: "streaming" value: "stream" } ]
    output_map [ { key: "output_ids" value: "_TOKENS_BATCH" },
                 { key: "sequence_length" value: "_SEQUENCE_LENGTH" } ] },
  { model_name: "postprocessing" model_version: -1
    input_map [ { key: "TOKENS_BATCH" value: "_TOKENS_BATCH" },
                { key: "SEQUENCE_LENGTH" value: "_SEQUENCE_LENGTH" } ]
    output_map { key: "OUTPUT" value: "text_output" } }
] }
""",
}


@pytest.fixture(scope="module")
def server(tmp_path_factory, model_path: Path):
    from tokenizers import Tokenizer

    from tokenmill.weights.tokenizer_source import load_tokenizer

    root = tmp_path_factory.mktemp("trtllm")
    load_tokenizer(model_path, None).save(root / "tokenizer")
    tokenizer = str(root / "tokenizer" / "tokenizer.json")
    # The streaming model includes the prompt in its output, as TensorRT-LLM's default does; the other
    # answers once (not decoupled) with the new tokens alone.
    # A third has no batch dimension (max_batch_size 0): its tensors are one sequence's.
    for name, decoupled, exclude, batch in (
        ("tensorrt_llm", "true", "false", 4),
        ("tensorrt_llm_once", "false", "true", 4),
        ("tensorrt_llm_flat", "false", "true", 0),
    ):
        cfg = TRTLLM.replace("NAME", name).replace("DECOUPLED", decoupled).replace("EXCLUDE", exclude)
        _write(root, name, cfg.replace("max_batch_size: 4", f"max_batch_size: {batch}"), None)
    for name, cfg in CONFIGS.items():
        code = {"preprocessing": PREPROCESS, "postprocessing": POSTPROCESS}.get(name)
        _write(root, name, cfg.replace("TOKENIZER", tokenizer), code)
    grpc_port = free_port()
    with running_server(
        "--model-repository", str(root), "--grpc-port", str(grpc_port), "--dtype", "float32"
    ) as proc:  # fmt: skip
        proc.grpc_url = f"127.0.0.1:{grpc_port}"
        proc.tokenizer = Tokenizer.from_file(tokenizer)  # as the preprocessing model tokenizes
        yield proc


@pytest.fixture(scope="module")
def reference(server, hf_model) -> dict[str, tuple[list[int], list[int], list[float]]]:
    """Each prompt's ids, transformers' greedy continuation, and the log prob of each token it chose."""
    out = {}
    for p in PROMPTS:
        ids = server.tokenizer.encode(p, add_special_tokens=False).ids
        tokens, logprobs = hf_greedy(hf_model, ids, NEW)
        out[p] = (ids, tokens, [float(lp[t]) for t, lp in zip(tokens, logprobs, strict=True)])
    return out


def _inputs(mod, values: dict[str, np.ndarray]) -> list:
    types = {np.int32: "INT32", np.float32: "FP32", np.bool_: "BOOL", np.uint64: "UINT64"}
    out = []
    for name, a in values.items():
        t = mod.InferInput(name, list(a.shape), types[a.dtype.type])
        t.set_data_from_numpy(a)
        out.append(t)
    return out


def _request(prompts: list[list[int]], **extra: np.ndarray) -> dict[str, np.ndarray]:
    """TensorRT-LLM's request tensors for a batch of prompts (padded, with their lengths)."""
    width = max(map(len, prompts))
    ids = np.zeros((len(prompts), width), np.int32)
    for i, p in enumerate(prompts):
        ids[i, : len(p)] = p
    n = len(prompts)
    return {
        "input_ids": ids,
        "input_lengths": np.array([[len(p)] for p in prompts], np.int32),
        "request_output_len": np.full((n, 1), NEW, np.int32),
        "temperature": np.zeros((n, 1), np.float32),
        **extra,
    }


def _completion(server, prompt: str, **body) -> str:
    req = {"model": LLM, "prompt": prompt, "max_tokens": NEW, "temperature": 0, **body}
    return httpx.post(f"{server.base_url}/v1/completions", json=req, timeout=120).json()["choices"][0]["text"]


def test_the_repository_loads_as_written(server) -> None:
    client = tritonclient_http.InferenceServerClient(server.base_url.removeprefix("http://"))
    index = {m["name"]: m["state"] for m in client.get_model_repository_index()}
    want = {"tensorrt_llm", "tensorrt_llm_once", "preprocessing", "postprocessing", "ensemble"}
    assert {n: index.get(n) for n in want} == dict.fromkeys(want, "READY")
    cfg = client.get_model_config("tensorrt_llm")  # the config as written, its policy included
    assert cfg["backend"] == "tensorrtllm" and cfg["model_transaction_policy"]["decoupled"] is True
    assert client.get_model_config("tensorrt_llm_once").get("model_transaction_policy", {}).get(
        "decoupled"
    ) in (
        None,
        False,
    )


def test_a_batch_of_two_matches_transformers_with_log_probs(server, reference) -> None:
    """Not decoupled, exclude_input_in_output: one response with both sequences' new tokens, padded."""
    prompts = [reference[p][0] for p in PROMPTS]
    values = _request(prompts, return_log_probs=np.ones((2, 1), bool), pad_id=np.full((2, 1), 7, np.int32))
    client = tritonclient_http.InferenceServerClient(server.base_url.removeprefix("http://"))
    r = client.infer("tensorrt_llm_once", _inputs(tritonclient_http, values))
    ids, lengths = r.as_numpy("output_ids"), r.as_numpy("sequence_length")
    assert ids.shape == (2, 1, NEW) and lengths.tolist() == [[NEW], [NEW]]
    for b, p in enumerate(PROMPTS):
        _, tokens, logprobs = reference[p]
        assert ids[b, 0].tolist() == tokens
        np.testing.assert_allclose(r.as_numpy("output_log_probs")[b, 0], logprobs, atol=LOGPROB_TOL)
        assert r.as_numpy("cum_log_probs")[b, 0] == pytest.approx(sum(logprobs), abs=NEW * LOGPROB_TOL)
    # The placeholder TensorRT-LLM sends for logits nobody asked for.
    assert r.as_numpy("context_logits").shape == (2, 1, 1)


def test_the_prompt_comes_first_unless_excluded_and_end_id_ends_it(server, reference) -> None:
    client = grpcclient.InferenceServerClient(server.grpc_url)
    prompts = [reference[p][0] for p in PROMPTS]
    assert len(prompts[0]) != len(prompts[1])  # (so that the shorter one is padded)
    values = _request(prompts, pad_id=np.full((2, 1), 7, np.int32))
    r = client.infer("tensorrt_llm", _inputs(grpcclient, values))  # decoupled, one response
    for b, p in enumerate(PROMPTS):
        ids, tokens, _ = reference[p]
        n = int(r.as_numpy("sequence_length")[b, 0])
        row = r.as_numpy("output_ids")[b, 0].tolist()
        assert n == len(ids) + NEW and row[:n] == ids + tokens and set(row[n:]) <= {7}
    assert r.as_numpy("output_ids").shape[2] == max(map(len, prompts)) + NEW
    # end_id: the sequence ends at it, and the end token is not part of the output (TensorRT-LLM's
    # executor leaves it out).
    ids, tokens, _ = reference[PROMPTS[0]]
    k = next(i for i in range(2, NEW) if tokens[i] not in tokens[:i])  # a token not seen before it
    values = _request([ids], end_id=np.array([[tokens[k]]], np.int32))
    r = client.infer("tensorrt_llm_once", _inputs(grpcclient, values))
    assert r.as_numpy("sequence_length").tolist() == [[k]]
    assert r.as_numpy("output_ids")[0, 0].tolist() == tokens[:k]


def test_stop_and_bad_word_lists(server, reference, hf_model) -> None:
    import torch

    ids, tokens, _ = reference[PROMPTS[0]]
    client = tritonclient_http.InferenceServerClient(server.base_url.removeprefix("http://"))
    # A stop word of two tokens, matched on tokens, stays in the output.
    stop = np.array([[tokens[2:4], [2, -1]]], np.int32)
    r = client.infer("tensorrt_llm_once", _inputs(tritonclient_http, _request([ids], stop_words_list=stop)))
    assert r.as_numpy("output_ids")[0, 0, : int(r.as_numpy("sequence_length")[0, 0])].tolist() == tokens[:4]
    # A bad word: the first token is then transformers' best other than it.
    bad = np.array([[[tokens[0]], [1]]], np.int32)
    r = client.infer("tensorrt_llm_once", _inputs(tritonclient_http, _request([ids], bad_words_list=bad)))
    with torch.no_grad():
        logits = hf_model(torch.tensor([ids])).logits[0, -1]
    logits[tokens[0]] = -float("inf")
    assert int(r.as_numpy("output_ids")[0, 0, 0]) == int(logits.argmax())


def test_streaming_sends_the_new_tokens_of_each_step(server, reference) -> None:
    ids, tokens, _ = reference[PROMPTS[1]]
    got: queue.Queue = queue.Queue()
    client = grpcclient.InferenceServerClient(server.grpc_url)
    client.start_stream(callback=lambda result, error: got.put((result, error)))
    try:
        values = _request([ids], streaming=np.ones((1, 1), bool), return_log_probs=np.ones((1, 1), bool))
        client.async_stream_infer("tensorrt_llm", _inputs(grpcclient, values), request_id="s")
        pieces, cum = [], []
        while True:
            result, error = got.get(timeout=60)
            assert error is None, error
            n = int(result.as_numpy("sequence_length")[0, 0])
            pieces.append(result.as_numpy("output_ids")[0, 0, :n].tolist())
            cum.append(float(result.as_numpy("cum_log_probs")[0, 0]))
            if result.get_response().parameters["triton_final_response"].bool_param:
                break
    finally:
        client.stop_stream()
        client.close()
    assert len(pieces) > 1 and sum(pieces, []) == tokens  # the prompt is not repeated in a stream
    # cum_log_probs is the sequence's so far in every response
    logprobs = reference[PROMPTS[1]][2]
    assert cum[-1] == pytest.approx(sum(logprobs), abs=NEW * LOGPROB_TOL)
    assert cum[0] == pytest.approx(sum(logprobs[: len(pieces[0])]), abs=NEW * LOGPROB_TOL)


def test_a_model_without_a_batch_dimension(server, reference) -> None:
    ids, tokens, _ = reference[PROMPTS[0]]
    values = {k: v[0] for k, v in _request([ids]).items()}  # one sequence's tensors, no batch
    client = tritonclient_http.InferenceServerClient(server.base_url.removeprefix("http://"))
    r = client.infer("tensorrt_llm_flat", _inputs(tritonclient_http, values))
    assert r.as_numpy("output_ids").shape == (1, NEW) and r.as_numpy("output_ids")[0].tolist() == tokens
    assert r.as_numpy("sequence_length").tolist() == [NEW]


def test_the_ensemble_answers_through_generate_and_generate_stream(server) -> None:
    want = _completion(server, PROMPTS[0])
    url = f"{server.base_url}/v2/models/ensemble/generate"
    body = {
        "text_input": PROMPTS[0],
        "max_tokens": NEW,
        "bad_words": "",
        "stop_words": "",
        "temperature": 0.0,
    }
    r = httpx.post(url, json=body, timeout=120)
    assert r.status_code == 200, r.text
    # The postprocessing decodes prompt and answer (TensorRT-LLM's default output): the answer follows.
    assert r.json()["text_output"] == PROMPTS[0] + want
    # Optional inputs left out (no word lists, no temperature) still run the pipeline; without top_k
    # or top_p TensorRT-LLM decodes greedily, and so does this.
    r = httpx.post(url, json={"text_input": PROMPTS[0], "max_tokens": 2}, timeout=120)
    assert r.status_code == 200 and r.json()["text_output"] == PROMPTS[0] + _completion(
        server, PROMPTS[0], max_tokens=2
    ), r.text
    s = httpx.post(url + "_stream", json=body | {"stream": True}, timeout=120)
    events = [json.loads(line[5:]) for line in s.text.splitlines() if line.startswith("data:")]
    assert len(events) > 1 and all("error" not in e for e in events), events
    assert "".join(e["text_output"] for e in events).strip() == want.strip()


@pytest.mark.parametrize(
    ("model", "extra", "match"),
    [
        ("tensorrt_llm_once", {"streaming": np.ones((1, 1), bool)}, "decoupled: true"),
        # infer takes one response: a streaming request is refused before it runs
        ("tensorrt_llm", {"streaming": np.ones((1, 1), bool)}, "takes one response"),
        ("tensorrt_llm", {"runtime_top_p": np.array([[1.5]], np.float32)}, "top_p"),
        ("tensorrt_llm", {"beam_width": np.array([[2]], np.int32)}, "beam search"),
        ("tensorrt_llm", {"lora_task_id": np.array([[3]], np.uint64)}, "LoRA by task id"),
        ("tensorrt_llm", {"input_lengths": np.array([[99]], np.int32)}, "input_lengths 99"),
        ("tensorrt_llm", {"stop_words_list": np.array([[[5, 6], [3, -1]]], np.int32)}, "offsets"),
    ],
)
def test_requests_it_cannot_serve_get_a_400(server, model: str, extra: dict, match: str) -> None:
    values = _request([[504, 3458, 282]]) | extra
    r = httpx.post(
        f"{server.base_url}/v2/models/{model}/infer",
        json={
            "inputs": [
                {"name": k, "shape": list(v.shape), "datatype": {np.int32: "INT32", np.float32: "FP32",
                 np.bool_: "BOOL", np.uint64: "UINT64"}[v.dtype.type], "data": v.reshape(-1).tolist()}
                for k, v in values.items()
            ]
        },
        timeout=60,
    )  # fmt: skip
    assert r.status_code == 400 and match in r.json()["error"], r.text


def test_a_stop_token_sequence_ends_a_request_in_the_engine() -> None:
    from tokenmill.engine.protocol import EngineRequest, FinishReason
    from tokenmill.engine.request import Request
    from tokenmill.sampling_params import SamplingParams

    params = SamplingParams(max_tokens=10, stop_token_sequences=[[5, 6], [9]])
    req = Request(EngineRequest("r", [1, 2], params, eos_token_ids=frozenset({0})), max_model_len=64)
    reasons = []
    for t in (6, 5, 7, 5, 6):  # 6 alone does not end it; 5 then 6 does
        req.append_token(t, 0.0)
        reasons.append(req.check_stop())
    assert reasons == [None, None, None, None, FinishReason.STOP]
    assert req.stop_token is None  # the words stay in the output
    with pytest.raises(ValueError, match="must not be empty"):
        SamplingParams(stop_token_sequences=[[]])


def test_without_a_served_llm_the_model_fails_to_load_saying_why(tmp_path: Path) -> None:
    import asyncio

    from tokenmill.triton.repository import ModelRepository

    cfg = TRTLLM.replace("NAME", "tensorrt_llm").replace("DECOUPLED", "true").replace("EXCLUDE", "false")
    _write(tmp_path, "tensorrt_llm", cfg, None)

    async def main() -> dict:
        models = ModelRepository(tmp_path)  # no add_llm: as tokenmill analyze's server runs
        await models.start()
        index = {m["name"]: m for m in models.index()}
        await models.close()
        return index["tensorrt_llm"]

    entry = asyncio.run(main())
    assert entry["state"] == "UNAVAILABLE" and "serves none" in entry["reason"], entry
