"""Decode speed of each weight precision against bf16, in one run, and how far each is from what
this machine's memory bandwidth allows.

The issue #17 workload: short prompts, 64 output tokens each, decoded together at 1 and 32 streams
(offline, `LLM.generate`). For every configuration: output tok/s, the ratio to bf16 in the same run, and
the share of the bandwidth limit: a decode step must read every weight the step's matmuls use (bf16: 2
bytes each; int8: 1, and a float16 scale per 32 in its group form; int4: half a byte plus its scales, at
every step where its panel kernel runs, elsewhere up to 4 rows, above which the layer uses its bf16 copy;
fp8: 1 where its panel kernel runs, else its codes as bf16) and the KV cache of every stream, so bytes per
step / read bandwidth is the fastest a step can be. The read bandwidth is measured here, in the same run,
with as many threads as the engine uses (a sum over 1 GiB).

    python benchmarks/quantized_decode.py [--streams 1,32] [--reps 3] [--only int8,"int8 groups"]
        [--model FILE.gguf]

--model: another model for every configuration (bf16 its weights as loaded; the quantized ones take a
GGUF's own codes where they can), such as benchmarks/peers/make_synthetic.py's; the embedded one without.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

from tokenmill import LLM, SamplingParams

sys.path.insert(0, str(Path(__file__).resolve().parent))
from machine import cpu_description  # noqa: E402
from step_bytes import read_bandwidth_gbs, weight_bytes  # noqa: E402

CONFIGS = [
    ("bf16", {}),
    ("int8", {"quantization": "int8"}),
    ("int8 groups", {"quantization": "int8", "int8_scales": "group"}),
    ("int4 a16", {"quantization": "int4", "int4_activations": "bf16"}),  # W4A16
    ("int4 a8", {"quantization": "int4", "int4_activations": "int8"}),  # W4A8, the default
    ("fp8", {"quantization": "fp8"}),
]
OUT = 64


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--streams", default="1,32")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--only", help="comma-separated precisions of the table to run (bf16 always runs)")
    ap.add_argument("--model", help="a model path for every configuration (default: the embedded one)")
    ap.add_argument("--kv-cache-memory-gb", type=float, default=1.0)
    args = ap.parse_args()
    wanted = None if args.only is None else {"bf16", *(w.strip() for w in args.only.split(","))}
    streams = [int(s) for s in args.streams.split(",")]
    bw = read_bandwidth_gbs()
    print(f"CPU: {cpu_description()}; torch threads {torch.get_num_threads()}; read bandwidth {bw:.1f} GB/s")
    print(f"model: {args.model or 'the embedded one'}")
    print(
        "| precision | streams | tok/s | vs bf16 | ms/step | weight MB/step | KV MB/step | limit ms/step "
        "| of limit |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    base: dict[int, float] = {}
    params = SamplingParams(temperature=0, max_tokens=OUT, ignore_eos=True)
    for name, kw in CONFIGS:
        if wanted is not None and name not in wanted:
            continue
        if args.model:  # a context that holds the prompts and their 64 tokens, which a big model's pool fits
            kw = {"model": args.model, "max_model_len": 512, **kw}
        kw = {**kw, "kv_cache_memory_gb": args.kv_cache_memory_gb}
        llm = LLM(max_num_seqs=max(streams), enable_prefix_caching=False, **kw)
        model = llm.engine.executor.worker.model
        cfg = llm.engine.executor.worker.model_config
        kv_per_token = 2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * 2  # bf16 K and V
        for n in streams:
            prompts = [f"Write a short story about a robot named R{i} who learns to paint." for i in range(n)]
            plen = statistics.mean(len(llm.tokenizer.encode(p)) for p in prompts)
            llm.generate(prompts, params)  # warm-up: shapes, caches
            runs = []
            for _ in range(args.reps):
                t = time.perf_counter()
                llm.generate(prompts, params)
                runs.append(time.perf_counter() - t)
            secs = statistics.median(runs)
            tps = n * OUT / secs
            base.setdefault(n, tps) if name == "bf16" else None
            step_ms = secs / OUT * 1e3
            wb = weight_bytes(model, n)
            kvb = n * (plen + OUT / 2) * kv_per_token  # the mean context over the 64 steps
            limit_ms = (wb + kvb) / (bw * 1e9) * 1e3
            print(
                f"| {name} | {n} | {tps:.1f} | {tps / base[n]:.2f}x | {step_ms:.1f} | {wb / 1e6:.0f} | "
                f"{kvb / 1e6:.1f} | {limit_ms:.1f} | {limit_ms / step_ms:.0%} |",
                flush=True,
            )
        del llm


if __name__ == "__main__":
    main()
