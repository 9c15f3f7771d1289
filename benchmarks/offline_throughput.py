"""Offline throughput of `LLM.generate` against HF `generate`, plus KV-reuse TTFT and batch-1 decode.

Everything is measured in one run on one machine, and the report gives ratios: absolute numbers on a
shared 2-core machine drift from run to run, ratios much less.

    python benchmarks/offline_throughput.py [--num-requests 256] [--dtype auto] [--skip-hf]
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time

import torch
from results_log import add_flag, record

from tokenmill import LLM, SamplingParams
from tokenmill.weights import catalog


def workload(n: int, vocab: int, seed: int) -> list[tuple[list[int], int]]:
    """n (prompt ids, output length) pairs: prompts 32-512 tokens, outputs 16-256 tokens, uniform."""
    rng = random.Random(seed)
    return [
        ([rng.randrange(100, vocab) for _ in range(rng.randint(32, 512))], rng.randint(16, 256))
        for _ in range(n)
    ]


def run_tokenmill(llm: LLM, reqs: list[tuple[list[int], int]]) -> tuple[float, int]:
    params = [SamplingParams(temperature=0, max_tokens=o, ignore_eos=True) for _, o in reqs]
    t0 = time.perf_counter()
    outs = llm.generate([p for p, _ in reqs], params, use_tqdm=True)
    dt = time.perf_counter() - t0
    return dt, sum(len(o.outputs[0].token_ids) for o in outs)


@torch.inference_mode()
def run_hf(model, reqs: list[tuple[list[int], int]], batch_size: int, pad_id: int) -> tuple[float, int]:
    """HF generate, batched as well as it can be: sorted by length (least padding), left-padded.

    A batch runs to its longest requested output; only the requested tokens are counted.
    """
    order = sorted(range(len(reqs)), key=lambda i: (len(reqs[i][0]), reqs[i][1]))
    useful = 0
    t0 = time.perf_counter()
    for b in range(0, len(order), batch_size):
        batch = [reqs[i] for i in order[b : b + batch_size]]
        width = max(len(p) for p, _ in batch)
        ids = torch.full((len(batch), width), pad_id, dtype=torch.long)
        mask = torch.zeros((len(batch), width), dtype=torch.long)
        for r, (p, _) in enumerate(batch):
            ids[r, width - len(p) :] = torch.tensor(p)
            mask[r, width - len(p) :] = 1
        new = max(o for _, o in batch)
        model.generate(
            input_ids=ids,
            attention_mask=mask,
            max_new_tokens=new,
            min_new_tokens=new,
            do_sample=False,
            pad_token_id=pad_id,
        )
        useful += sum(o for _, o in batch)
    return time.perf_counter() - t0, useful


def ttft_with_shared_prefix(llm: LLM, vocab: int, prefix_len: int, trials: int) -> tuple[float, float]:
    """Median TTFT (s) of a prefix+suffix prompt: cold (prefix cache emptied) and warm (prefix cached)."""
    rng = random.Random(1)
    prefix = [rng.randrange(100, vocab) for _ in range(prefix_len)]
    p = SamplingParams(temperature=0, max_tokens=1)

    def one(cold: bool) -> float:
        if cold:
            llm.engine.kv.pool.reset_prefix_cache()
        suffix = [rng.randrange(100, vocab) for _ in range(32)]
        out = llm.generate([prefix + suffix], p)[0]
        return out.outputs[0].metrics.ttft

    one(False)  # warm-up, and it puts the prefix in the cache
    cold = statistics.median(one(True) for _ in range(trials))
    one(False)
    warm = statistics.median(one(False) for _ in range(trials))
    return cold, warm


def single_stream(llm: LLM, n_tokens: int) -> float:
    """Decode tokens/s of one request (time after the first token)."""
    p = SamplingParams(temperature=0, max_tokens=n_tokens, ignore_eos=True)
    llm.generate("Warm-up", SamplingParams(max_tokens=8))
    m = llm.generate("Once upon a time", p)[0].outputs[0].metrics
    return (n_tokens - 1) / (m.token_times[-1] - m.token_times[0])


@torch.inference_mode()
def hf_single_stream(model, n_tokens: int) -> float:
    ids = torch.tensor([[504, 2365, 6354, 16438]])
    model.generate(ids, max_new_tokens=8, do_sample=False)
    t0 = time.perf_counter()
    model.generate(ids, max_new_tokens=1, do_sample=False)
    first = time.perf_counter() - t0
    t0 = time.perf_counter()
    model.generate(ids, max_new_tokens=n_tokens, min_new_tokens=n_tokens, do_sample=False)
    return (n_tokens - 1) / (time.perf_counter() - t0 - first)


def dense_weights(gguf_file: str) -> dict:
    """transformers' arguments for plain dense weights of the file's tensors. From 5.x it keeps a GGUF
    file's blocks packed by default and unpacks them in every matmul: a slower baseline than the dense
    model users run, and not the one this benchmark's earlier figures were set against."""
    try:
        from transformers import GgufConfig
    except ImportError:  # before 5.x: dequantized at load, always
        return {}
    return {"quantization_config": GgufConfig(gguf_file=gguf_file, dequantize=True)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--num-requests", type=int, default=256)
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--hf-batch-size", type=int, default=32)
    ap.add_argument("--skip-hf", action="store_true")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", help="write the figures to this file")
    add_flag(ap)
    args = ap.parse_args()

    llm = LLM(dtype=args.dtype)
    # The arithmetic tokenmill computes in ("auto": float32 on CPUs without BF16 instructions), which
    # transformers runs in too, so that both sides compute alike.
    arithmetic = llm.engine.executor.worker.dtype  # type: ignore[attr-defined]
    res_dtype = str(arithmetic).removeprefix("torch.")
    vocab = llm.engine.model_config.vocab_size
    reqs = workload(args.num_requests, vocab, args.seed)
    res: dict[str, float | str] = {"threads": torch.get_num_threads(), "arithmetic": res_dtype}

    res["tokenmill_single_stream_tok_s"] = single_stream(llm, 128)
    res["tokenmill_int4_single_stream_tok_s"] = single_stream(LLM(dtype=args.dtype, quantization="int4"), 128)
    cold, warm = ttft_with_shared_prefix(llm, vocab, 512, 5)
    res["ttft_cold_ms"], res["ttft_warm_ms"], res["ttft_speedup"] = cold * 1e3, warm * 1e3, cold / warm
    dt, toks = run_tokenmill(llm, reqs)
    res["tokenmill_seconds"], res["tokenmill_output_tok_s"] = dt, toks / dt
    del llm

    if not args.skip_hf:
        from transformers import AutoModelForCausalLM

        path = catalog.resolve(catalog.DEFAULT_MODEL)
        model = AutoModelForCausalLM.from_pretrained(
            str(path.parent), gguf_file=path.name, dtype=arithmetic, **dense_weights(path.name)
        )
        model.eval()
        res["hf_single_stream_tok_s"] = hf_single_stream(model, 128)
        dt, toks = run_hf(model, reqs, args.hf_batch_size, pad_id=2)
        res["hf_seconds"], res["hf_output_tok_s"] = dt, toks / dt
        res["throughput_ratio"] = res["tokenmill_output_tok_s"] / res["hf_output_tok_s"]
        res["single_stream_ratio"] = res["tokenmill_single_stream_tok_s"] / res["hf_single_stream_tok_s"]

    for k, v in res.items():
        print(f"{k:32s} {v:>10}" if isinstance(v, str) else f"{k:32s} {v:10.2f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "results": res}, f, indent=1)
    record("offline_throughput", res, args=args)


if __name__ == "__main__":
    main()
