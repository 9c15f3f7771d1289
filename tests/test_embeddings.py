"""Embeddings: `LLM.embed` and `/v1/embeddings` (with `/v1/score` and `/v1/rerank`) against transformers'
final hidden states of the same model, float32, pooled the same way, within 1e-4."""

from __future__ import annotations

import base64
import json
import math

import httpx
import numpy as np
import openai
import pytest
import torch
from server_fixture import running_server

from tokenmill import LLM, SamplingParams
from tokenmill.pooling import Pooling, finish, model_pooling

pytestmark = pytest.mark.slow

MODEL = "smollm2-135m"
TEXTS = [
    "The capital of France is Paris.",
    "An embedding maps a text to a vector; texts with close meanings get close vectors. " * 3,
    "hi",
]
TOL = 1e-4


def reference(hf_model, ids: list[int], pooling: str, normalize: bool) -> np.ndarray:
    with torch.no_grad():
        h = hf_model.model(torch.tensor([ids])).last_hidden_state[0].double()
    v = {"last": h[-1], "mean": h.mean(0), "cls": h[0]}[pooling].numpy()
    return v / np.linalg.norm(v) if normalize else v


@pytest.fixture(scope="module")
def llm_chunked():
    """Float32, a prompt read 16 tokens a step: the longer texts take several chunks."""
    llm = LLM(dtype="float32", max_model_len=512, max_num_batched_tokens=16)
    yield llm
    llm.close()


@pytest.mark.parametrize("pooling", ["last", "mean", "cls"])
def test_llm_embed_equals_transformers(llm_chunked: LLM, hf_model, pooling: str) -> None:
    for normalize in (False, True):
        outs = llm_chunked.embed(TEXTS, pooling=pooling, normalize=normalize)
        for o in outs:
            ref = reference(hf_model, o.prompt_token_ids, pooling, normalize)
            got = np.asarray(o.outputs.embedding)
            scale = 1.0 if normalize else np.abs(ref).max()  # raw states reach ~30: relative to that
            assert np.abs(got - ref).max() <= TOL * scale, (pooling, normalize, len(o.prompt_token_ids))
    assert len(outs[1].prompt_token_ids) > 16  # it did take several chunks


def test_prefix_hits_and_mixed_batches_change_nothing(llm_chunked: LLM, hf_model) -> None:
    # Last-token pooling may start from cached blocks (the same text again); mean pooling never does.
    # Embedding and generating requests share steps.
    for pooling in ("last", "mean"):
        first = llm_chunked.embed(TEXTS[1], pooling=pooling)[0].outputs.embedding
        again = llm_chunked.embed(TEXTS[1], pooling=pooling)[0].outputs.embedding
        assert np.abs(np.asarray(first) - np.asarray(again)).max() <= TOL
    greedy = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    alone = llm_chunked.generate([TEXTS[0]], greedy)[0].outputs[0].text
    mixed = llm_chunked.generate(
        [TEXTS[0], TEXTS[1], TEXTS[2]], [greedy, SamplingParams(max_tokens=1, pooling="mean"), greedy]
    )
    assert mixed[0].outputs[0].text == alone and mixed[0].outputs[0].embedding is None
    pooled = np.asarray(mixed[1].outputs[0].embedding)
    ref = reference(hf_model, mixed[1].prompt_token_ids, "mean", False)
    assert np.abs(pooled - ref).max() <= TOL * np.abs(ref).max()
    assert mixed[1].outputs[0].token_ids == [] and mixed[1].outputs[0].finish_reason == "stop"


def test_sentence_transformers_folder_says_how_to_pool(tmp_path) -> None:
    assert model_pooling("smollm2-135m") == Pooling("last", True)
    (tmp_path / "1_Pooling").mkdir()
    (tmp_path / "1_Pooling" / "config.json").write_text(json.dumps({"pooling_mode_mean_tokens": True}))
    assert model_pooling(str(tmp_path)) == Pooling("mean", False)
    modules = [
        {"type": "sentence_transformers.models.Pooling"},
        {"type": "sentence_transformers.models.Normalize"},
    ]
    (tmp_path / "modules.json").write_text(json.dumps(modules))
    assert model_pooling(str(tmp_path)) == Pooling("mean", True)
    (tmp_path / "1_Pooling" / "config.json").write_text(json.dumps({"pooling_mode_max_tokens": True}))
    with pytest.raises(ValueError, match="no pooling mode"):
        model_pooling(str(tmp_path))
    # Matryoshka: the leading dimensions, scaled to unit length again.
    assert finish([3.0, 4.0, 12.0], True, 2) == [0.6, 0.8]
    with pytest.raises(ValueError, match="dimensions"):
        finish([1.0], True, 2)


@pytest.fixture(scope="module")
def server():
    with running_server("--dtype", "float32", "--max-num-batched-tokens", "32") as proc:
        yield proc


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="unused", max_retries=0)


def test_openai_embeddings_equal_transformers(client: openai.OpenAI, server, hf_model) -> None:
    r = client.embeddings.create(model=MODEL, input=TEXTS)  # the client asks for base64 and decodes it
    ids = [httpx.post(f"{server.base_url}/tokenize", json={"prompt": t}).json()["tokens"] for t in TEXTS]
    assert [d.index for d in r.data] == [0, 1, 2] and r.usage.prompt_tokens == sum(map(len, ids))
    for d, prompt in zip(r.data, ids, strict=True):
        assert np.abs(np.asarray(d.embedding) - reference(hf_model, prompt, "last", True)).max() <= TOL
    # Floats as JSON, token ids as input, and the leading dimensions alone.
    raw = httpx.post(
        f"{server.base_url}/v1/embeddings",
        json={"input": [ids[0], ids[2]], "encoding_format": "float", "dimensions": 64},
    ).json()
    for item, prompt in zip(raw["data"], [ids[0], ids[2]], strict=True):
        full = reference(hf_model, prompt, "last", False)[:64]
        assert np.abs(np.asarray(item["embedding"]) - full / np.linalg.norm(full)).max() <= TOL
    b64 = httpx.post(
        f"{server.base_url}/v1/embeddings", json={"input": TEXTS[0], "encoding_format": "base64"}
    ).json()["data"][0]["embedding"]
    decoded = np.frombuffer(base64.b64decode(b64), dtype="<f4")
    assert np.abs(decoded - np.asarray(r.data[0].embedding)).max() <= 1e-6
    # More inputs than the server admits sequences at once (langchain sends 1,000): they run in waves.
    assert len(client.embeddings.create(model=MODEL, input=["x"] * 600).data) == 600


def test_score_and_rerank_are_cosines_of_embeddings(client: openai.OpenAI, server) -> None:
    query, docs = "Paris is the capital of France.", ["France's capital city", "A cat sleeps.", "Rome"]
    vecs = [np.asarray(d.embedding) for d in client.embeddings.create(model=MODEL, input=[query, *docs]).data]
    cos = [float(vecs[0] @ v / np.linalg.norm(vecs[0]) / np.linalg.norm(v)) for v in vecs[1:]]
    scores = httpx.post(f"{server.base_url}/v1/score", json={"text_1": query, "text_2": docs}).json()
    assert [round(d["score"], 4) for d in scores["data"]] == [round(c, 4) for c in cos]
    ranked = httpx.post(
        f"{server.base_url}/v1/rerank", json={"query": query, "documents": docs, "top_n": 2}
    ).json()
    order = sorted(range(3), key=lambda i: -cos[i])[:2]
    assert [x["index"] for x in ranked["results"]] == order
    assert all(math.isclose(x["relevance_score"], cos[x["index"]], abs_tol=1e-4) for x in ranked["results"])


@pytest.mark.parametrize(
    ("body", "needle"),
    [
        ({"input": ""}, "empty string"),
        ({"input": []}, "must not be empty"),
        ({"input": "hi", "dimensions": 100000}, "dimensions must be between"),
        ({"input": "word " * 2000}, "maximum context length"),
        ({"input": [[1, 2], [99999999]]}, "token ids must be in"),
        ({"input": "hi", "model": "text-embedding-9"}, "does not exist"),
        ({"input": "hi", "encoding_format": "int8"}, "encoding_format"),
    ],
)
def test_bad_input_is_4xx(server, body: dict, needle: str) -> None:
    r = httpx.post(f"{server.base_url}/v1/embeddings", json=body)
    assert r.status_code in (400, 404) and needle in r.json()["error"]["message"], r.text
