"""Embeddings per second: tokenmill's `LLM.embed` against transformers computing the same pooled hidden
states (the embedded SmolLM2-135M, last-token pooling, normalized), at batch 1 and batch 64, in one run
and interleaved (absolute times on a shared 2-core machine drift; ratios much less). Also the response
store's memory per stored response (the Responses API's `store: true`).

- tokenmill: `LLM(dtype="auto")` (the engine's default); batch 1 is one `embed` call per text, batch 64
  one call with 64 texts (the scheduler batches and chunks them). Each round's passages are new, so
  no prefix-cache hit shortens them.
- transformers: `AutoModel` on the same GGUF weights, in the arithmetic tokenmill picked (float32 on a CPU
  without BF16 instructions); batch 1 one forward per text, batch 64 one right-padded forward with an
  attention mask, the last real token of each row pooled.
- The two must agree: the worst cosine between their vectors is reported (and must be above 0.999).
- Store: tracemalloc's count of the bytes 1,000 stored responses take (a 3-turn conversation and a
  ~150-word answer each), divided by 1,000, beside the store's own accounting of their JSON size.

    python benchmarks/embeddings.py [--texts 64] [--repeats 3] [--quick]
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time
import tracemalloc
from pathlib import Path

import numpy as np
import torch
import transformers

sys.path.insert(0, str(Path(__file__).resolve().parent))
from machine import cpu_description  # noqa: E402
from results_log import add_flag, record  # noqa: E402

from tokenmill import LLM  # noqa: E402
from tokenmill.server.response_store import ResponseStore, StoredResponse  # noqa: E402
from tokenmill.weights import catalog  # noqa: E402

PASSAGE = """the model reads a passage and maps it to a vector so that passages with close meanings land
near each other search engines rank documents by that distance retrieval pipelines store millions of
such vectors and compare a question against them in milliseconds"""
WORDS = tuple(PASSAGE.split())


def passages(n: int, words: int, seed: int = 0) -> list[str]:
    rng = random.Random(seed)
    return [" ".join(rng.choice(WORDS) for _ in range(words)) for _ in range(n)]


def hf_embed(model, tok, texts: list[str], batch: int) -> list[np.ndarray]:
    out = []
    with torch.no_grad():
        for i in range(0, len(texts), batch):
            chunk = texts[i : i + batch]
            ids = [tok.encode(t, add_special_tokens=True) for t in chunk]
            width = max(map(len, ids))
            x = torch.zeros((len(ids), width), dtype=torch.long)
            mask = torch.zeros((len(ids), width), dtype=torch.long)
            for r, row in enumerate(ids):
                x[r, : len(row)] = torch.tensor(row)
                mask[r, : len(row)] = 1
            h = model(input_ids=x, attention_mask=mask).last_hidden_state.float()
            for r, row in enumerate(ids):
                v = h[r, len(row) - 1].numpy()
                out.append(v / np.linalg.norm(v))
    return out


def timed(fn, *args) -> tuple[float, object]:
    t0 = time.perf_counter()
    result = fn(*args)
    return time.perf_counter() - t0, result


def store_bytes_per_response(n: int = 1000) -> tuple[float, float]:
    answer = " ".join(passages(1, 150, seed=1))
    conversation = [
        {"role": "user", "content": " ".join(passages(1, 40, seed=2))},
        {"role": "assistant", "content": answer},
        {"role": "user", "content": " ".join(passages(1, 30, seed=3))},
        {"role": "assistant", "content": answer},
    ]
    store = ResponseStore(max_responses=10 * n, max_bytes=2**31, ttl_s=3600)
    tracemalloc.start()
    before = tracemalloc.get_traced_memory()[0]
    for i in range(n):
        output = [{"type": "message", "id": f"msg_{i}", "role": "assistant", "status": "completed",
                   "content": [{"type": "output_text", "text": answer, "annotations": []}]}]  # fmt: skip
        response = {"id": f"resp_{i}", "object": "response", "status": "completed", "output": output}
        items = [{"id": f"in_{i}", "type": "message", "role": "user", "content": conversation[-2]["content"]}]
        # Each response a fresh copy of its strings, as responses parsed from JSON would be.
        messages = [{k: (v + " ")[:-1] for k, v in m.items()} for m in conversation]
        store.put(f"resp_{i}", StoredResponse("owner", response, items, messages, store.expiry()))
    traced = tracemalloc.get_traced_memory()[0] - before
    tracemalloc.stop()
    return traced / n, store.bytes / n


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--texts", type=int, default=64)
    ap.add_argument("--words", type=int, default=96, help="words per passage (about a token each)")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--quick", action="store_true", help="a smoke test: few texts, one repeat, not recorded")
    add_flag(ap)
    args = ap.parse_args()
    if args.quick:
        args.texts, args.repeats, args.no_record = 8, 1, True
    llm = LLM(dtype="auto", max_model_len=1024)
    arithmetic = llm.engine.executor.worker.dtype  # type: ignore[attr-defined]
    path = catalog.installed_file(catalog.CATALOG[catalog.DEFAULT_MODEL])
    assert path is not None, "the embedded model is not installed: tokenmill models pull smollm2-135m"
    hf = transformers.AutoModel.from_pretrained(
        str(path.parent), gguf_file=path.name, dtype=arithmetic
    ).eval()
    tok = transformers.AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    print(f"{cpu_description()}; {args.texts} passages of {args.words} words; arithmetic {arithmetic}")

    warm = passages(2, args.words, seed=-1)
    llm.embed(warm)  # warm both (kernels built, pages touched)
    hf_embed(hf, tok, warm, 1)
    times: dict[str, list[float]] = {k: [] for k in ("tm1", "hf1", "tm64", "hf64")}
    ours = theirs = None
    for rep in range(args.repeats):
        # Passages never seen before in each round: a repeated one would be a prefix-cache hit (last-token
        # pooling takes them), which would measure the cache, not the model.
        texts = passages(args.texts, args.words, seed=2 * rep)
        one = passages(max(8, args.texts // 8), args.words, seed=2 * rep + 1)  # batch 1: one each
        t, _ = timed(lambda batch: [llm.embed(x) for x in batch], one)
        times["tm1"].append(len(one) / t)
        t, _ = timed(hf_embed, hf, tok, one, 1)
        times["hf1"].append(len(one) / t)
        t, ours = timed(llm.embed, texts)
        times["tm64"].append(len(texts) / t)
        t, theirs = timed(hf_embed, hf, tok, texts, len(texts))
        times["hf64"].append(len(texts) / t)
    worst = min(
        float(np.dot(np.asarray(a.outputs.embedding), b))
        for a, b in zip(ours, theirs, strict=True)  # type: ignore[arg-type]
    )
    per_response, per_response_json = store_bytes_per_response()
    med = {k: statistics.median(v) for k, v in times.items()}
    res = {
        "arithmetic": str(arithmetic).removeprefix("torch."),
        "texts": args.texts,
        "tokenmill_b1_per_s": round(med["tm1"], 2),
        "hf_b1_per_s": round(med["hf1"], 2),
        "ratio_b1": round(med["tm1"] / med["hf1"], 3),
        "tokenmill_b64_per_s": round(med["tm64"], 2),
        "hf_b64_per_s": round(med["hf64"], 2),
        "ratio_b64": round(med["tm64"] / med["hf64"], 3),
        "ratio_worst": round(min(med["tm1"] / med["hf1"], med["tm64"] / med["hf64"]), 3),
        "worst_cosine": round(worst, 6),
        "store_bytes_per_response": round(per_response),
        "store_json_bytes_per_response": round(per_response_json),
    }
    for k, v in res.items():
        print(f"{k:32s} {v}")
    assert worst > 0.999, f"tokenmill and transformers disagree: worst cosine {worst}"
    record("embeddings", res, args=args)
    llm.close()


if __name__ == "__main__":
    main()
