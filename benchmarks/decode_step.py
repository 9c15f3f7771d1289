"""Decode speed with the C++ decode step (models/decode_step.py) against the Python layer loop, in one
process: the same model, its step switched on and off run by run, the ratio of each pair of runs.

The issue #17 workload (offline `LLM.generate`, short prompts, 64 output tokens each), at each stream
count. Where the step does not take the model (its kernels), the script says so and stops.

    python benchmarks/decode_step.py [--streams 1,4,32] [--rounds 5] [--quantization int4]
        [--model FILE.gguf]
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

OUT = 64


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--streams", default="1,4,32")
    ap.add_argument("--rounds", type=int, default=5, help="pairs of runs per stream count")
    ap.add_argument("--quantization", default=None, help="int4, int8 (its group form here) or none")
    ap.add_argument("--model", help="a model path (default: the embedded one)")
    args = ap.parse_args()
    streams = [int(s) for s in args.streams.split(",")]
    kw: dict[str, object] = {"max_num_seqs": max(streams), "enable_prefix_caching": False}
    if args.model:
        kw |= {"model": args.model, "max_model_len": 512}
    if args.quantization:
        kw["quantization"] = args.quantization
    if args.quantization == "int8":
        kw["int8_scales"] = "group"
    llm = LLM(kv_cache_memory_gb=1.0, **kw)
    model = llm.engine.executor.worker.model  # type: ignore[attr-defined]
    step = model.layer_loop  # the runner's choice (worker/model_runner.py)
    print(f"CPU: {cpu_description()}; torch threads {torch.get_num_threads()}")
    print(f"model: {args.model or 'the embedded one'}, quantization {args.quantization or 'none (bf16)'}")
    if step is None:
        print("the C++ decode step does not take this model here (models/decode_step.py): nothing to compare")
        return
    params = SamplingParams(temperature=0, max_tokens=OUT, ignore_eos=True)
    print("| streams | Python loop tok/s | C++ step tok/s | C++ / Python (median of pairs) | pair ratios |")
    print("|---|---|---|---|---|")
    for n in streams:
        prompts = [f"Write a short story about a robot named R{i} who learns to paint." for i in range(n)]
        llm.generate(prompts, params)  # warm-up: shapes, caches

        def timed(with_step: bool, prompts: list[str] = prompts) -> float:
            model.layer_loop = step if with_step else None
            t = time.perf_counter()
            outs = llm.generate(prompts, params)
            dt = time.perf_counter() - t
            return sum(len(o.outputs[0].token_ids) for o in outs) / dt

        fast, slow, ratios = [], [], []
        for r in range(args.rounds):
            # Alternate which goes first: a drift of the machine within a pair then favours neither.
            if r % 2:
                a, b = timed(True), timed(False)
            else:
                b, a = timed(False), timed(True)
            fast.append(a)
            slow.append(b)
            ratios.append(a / b)
        model.layer_loop = step
        spread = ", ".join(f"{x:.2f}" for x in sorted(ratios))
        print(
            f"| {n} | {statistics.median(slow):.1f} | {statistics.median(fast):.1f} | "
            f"**{statistics.median(ratios):.2f}x** | {spread} |",
            flush=True,
        )


if __name__ == "__main__":
    main()
