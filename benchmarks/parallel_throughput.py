"""Offline throughput and single-stream decode for each tensor x pipeline layout, in one run.

The same workload (64 requests, prompts 32-512 tokens, outputs 16-128) for one worker in the engine
process and for each layout of rank processes; the report gives each layout's ratio to the first.
On a machine with few cores, more ranks share the same cores, so expect them to be slower: this
measures what the split costs (collectives, activations between stages, per-process overhead).

    python benchmarks/parallel_throughput.py [--layouts 1x1,2x1,1x2,2x2] [--dtype bfloat16]
"""

from __future__ import annotations

import argparse
import random
import time

from tokenmill import LLM, SamplingParams


def workload(n: int, seed: int) -> list[tuple[list[int], int]]:
    rng = random.Random(seed)
    return [
        ([rng.randrange(100, 49000) for _ in range(rng.randint(32, 512))], rng.randint(16, 128))
        for _ in range(n)
    ]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument(
        "--layouts", default="1x1,2x1,1x2,2x2", help="TPxPP, comma-separated; the first is the baseline"
    )
    ap.add_argument("--num-requests", type=int, default=64)
    ap.add_argument("--dtype", default="bfloat16")
    args = ap.parse_args()
    reqs = workload(args.num_requests, 0)
    rows = []
    for layout in args.layouts.split(","):
        tp, pp = (int(x) for x in layout.split("x"))
        llm = LLM(dtype=args.dtype, tensor_parallel_size=tp, pipeline_parallel_size=pp)
        try:
            llm.generate("Warm-up", SamplingParams(max_tokens=8))
            params = [SamplingParams(temperature=0, max_tokens=o, ignore_eos=True) for _, o in reqs]
            t0 = time.perf_counter()
            outs = llm.generate([p for p, _ in reqs], params)
            dt = time.perf_counter() - t0
            tokens = sum(len(o.outputs[0].token_ids) for o in outs)
            m = llm.generate(
                "Once upon a time", SamplingParams(temperature=0, max_tokens=64, ignore_eos=True)
            )[0]
            times = m.outputs[0].metrics.token_times
            single = (len(times) - 1) / (times[-1] - times[0])
        finally:
            llm.engine.shutdown()
        rows.append((layout, tokens / dt, single))
        print(
            f"{layout}: {tokens / dt:.1f} output tok/s offline, {single:.1f} tok/s single stream", flush=True
        )
    base = rows[0]
    print(f"\n| layout (TPxPP) | offline tok/s | vs {base[0]} | single stream tok/s | vs {base[0]} |")
    print("|---|---|---|---|---|")
    for layout, thr, single in rows:
        print(f"| {layout} | {thr:.1f} | {thr / base[1]:.2f}x | {single:.1f} | {single / base[2]:.2f}x |")


if __name__ == "__main__":
    main()
