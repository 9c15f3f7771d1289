"""Speculative decoding against plain decoding, in one run: tokens/s and how many greedy texts are
identical to plain decoding's, on input-grounded tasks (edit or extract from a given text or code:
the output repeats the input) and on open-ended chat (little to copy), at 1, 8 and 32 streams.

Each method gets a fresh engine on the embedded model; every figure is a ratio against no speculation
measured in the same run (the median of --repeats runs of each batch).

    python benchmarks/spec_decode.py [--methods ngram,suffix] [--max-tokens 192] [--repeats 3]
"""

from __future__ import annotations

import argparse
import statistics
import time

from results_log import add_flag, record

from tokenmill import LLM
from tokenmill.sampling_params import SamplingParams

CODE = """def summarize(orders):
    total = 0
    count = 0
    for order in orders:
        if order.status == "paid":
            total += order.amount
            count += 1
    average = total / count if count else 0
    return {"total": total, "count": count, "average": average}
"""
TEXT = (
    "The lighthouse stood on the northern cliff for two hundred years. Its keeper, Ada Morgan, climbed "
    "the one hundred and twelve steps every evening at dusk to light the lamp. Ships from Bergen and "
    "Aberdeen steered by its beam through the narrow channel. In 1952 the lamp was electrified, and in "
    "1987 the last keeper left; since then the light has been run from the harbour office in town."
)
GROUNDED = [
    f"Rename the variable `total` to `revenue` in this code and output the whole code:\n\n{CODE}",
    f"Add a docstring to this function and output the whole function:\n\n{CODE}",
    f"Copy the following text exactly, then say 'done':\n\n{TEXT}",
    f"Correct the spelling in this text and output it in full:\n\n{TEXT.replace('the', 'teh')}",
]
CHAT = [
    "Write a short poem about autumn leaves.",
    "Give me three tips for learning to cook.",
    "Explain why the sky is blue to a child.",
    "Describe a day at the beach in a few sentences.",
]


def run(method: str | None, prompts: list[str], streams: int, args: argparse.Namespace):
    max_tokens, repeats = args.max_tokens, args.repeats
    spec = {"speculative_config": {"method": method, "num_speculative_tokens": args.k}} if method else {}
    llm = LLM(dtype=args.dtype, max_model_len=2048, **spec)
    p = SamplingParams(temperature=0, max_tokens=max_tokens)
    batch = [[{"role": "user", "content": prompts[i % len(prompts)]}] for i in range(streams)]
    try:
        llm.chat(batch[:1], SamplingParams(temperature=0, max_tokens=8))  # warm-up
        rates, texts = [], None
        for _ in range(repeats):
            if streams == 1:  # single stream: one conversation at a time
                t0 = time.perf_counter()
                outs = [llm.chat([m], p)[0] for m in [[{"role": "user", "content": q}] for q in prompts]]
            else:
                t0 = time.perf_counter()
                outs = llm.chat(batch, p)
            dt = time.perf_counter() - t0
            rates.append(sum(len(o.outputs[0].token_ids) for o in outs) / dt)
            texts = [o.outputs[0].token_ids for o in outs]
        st = llm.engine.stats()
    finally:
        llm.close()
    acc = st.spec_num_accepted_tokens / st.spec_num_draft_tokens if st.spec_num_draft_tokens else 0.0
    mean_len = 1 + st.spec_num_accepted_tokens / st.spec_num_drafts if st.spec_num_drafts else 1.0
    return statistics.median(rates), texts, acc, mean_len


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--methods", default="ngram,suffix")
    ap.add_argument("--max-tokens", type=int, default=192)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--streams", default="1,8,32")
    ap.add_argument("--k", type=int, default=8, help="most draft tokens per step")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--workloads", default="grounded,chat")
    add_flag(ap)
    args = ap.parse_args()
    methods = args.methods.split(",")
    print(f"{'workload':10} {'streams':>7} {'method':8} {'tok/s':>8} {'ratio':>6} {'accept':>7} "
          f"{'tok/step':>8} identical")  # fmt: skip
    workloads = {"grounded": GROUNDED, "chat": CHAT}
    metrics: dict[str, float] = {}
    for name in args.workloads.split(","):
        prompts = workloads[name]
        for streams in map(int, args.streams.split(",")):
            base, base_texts, _, _ = run(None, prompts, streams, args)
            print(f"{name:10} {streams:7} {'none':8} {base:8.1f} {1.0:6.2f} {'':>7} {1.0:8.2f}", flush=True)
            for m in methods:
                rate, texts, acc, mean_len = run(m, prompts, streams, args)
                same = sum(a == b for a, b in zip(texts, base_texts, strict=True))
                row = f"{name:10} {streams:7} {m:8} {rate:8.1f} {rate / base:6.2f} {acc:7.0%} {mean_len:8.2f}"
                print(f"{row} {same}/{len(texts)}", flush=True)
                metrics[f"{name}_{streams}_{m}"] = round(rate / base, 3)
            ratios = [metrics[f"{name}_{streams}_{m}"] for m in methods]
            if streams == 1:  # the goals: grounded with the best proposer, chat with the worst
                metrics[f"{name}_1_stream_speedup"] = max(ratios)
                metrics[f"{name}_1_stream_speedup_worst"] = min(ratios)
    record("spec_decode", metrics, args=args)


if __name__ == "__main__":
    main()
