"""How often a seeded request's sampled tokens change when its prompt's prefix is cached, and what a
seeded draw costs.

A seeded request draws each token by an exponential race on noise that depends only on its seed and the
output position (worker/sampler.py), so what can still change its tokens is its logits: with the prefix
cached the prompt's remaining tokens are computed in a smaller pass that attends to the cached keys and
values, and the rounding differs. For each prompt (a shared preamble, then a question) and seed this runs
the request with an empty prefix cache ("cold") and again with the whole prompt cached ("warm"), and
counts the requests whose tokens differ, with the first position where they do; greedy requests the same
way, for scale. Then it times the sampler on a batch of 32 rows of the model's vocabulary, seeded against
unseeded (the baseline, in the same run).

    .venv/bin/python benchmarks/seeded_prefix_cache.py [--dtype bfloat16] [--seeds 5] [--max-tokens 48]

Figures: docs/history/benchmarks.md, "Seeded sampling and the prefix cache".
"""

from __future__ import annotations

import argparse
import statistics

from results_log import add_flag, record

PREAMBLE = "You are a helpful assistant who writes short stories about animals living in a quiet forest. " * 3
QUESTIONS = [
    "Tell me about the fox.",
    "Tell me about the owl.",
    "What does the bear eat?",
    "Write a poem about rain.",
    "Describe the river.",
    "Why do birds sing?",
]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--seeds", type=int, default=5)
    ap.add_argument("--first-seed", type=int, default=0)
    ap.add_argument("--max-tokens", type=int, default=48)
    ap.add_argument("--temperature", type=float, default=1.0)
    ap.add_argument("--top-k", type=int, default=0)
    add_flag(ap)
    args = ap.parse_args()

    from tokenmill import LLM, SamplingParams

    llm = LLM(dtype=args.dtype, max_model_len=1024)
    pool = llm.engine.kv.pool
    differ: list[int] = []  # first differing position of each request that differs
    total = 0
    for seed in range(args.first_seed, args.first_seed + args.seeds):
        params = SamplingParams(
            temperature=args.temperature,
            top_k=args.top_k,
            max_tokens=args.max_tokens,
            seed=seed,
            ignore_eos=True,
        )
        for q in QUESTIONS:
            pool.reset_prefix_cache()
            cold = llm.generate(PREAMBLE + q, params)[0]
            warm = llm.generate(PREAMBLE + q, params)[0]
            assert cold.num_cached_tokens == 0 < warm.num_cached_tokens
            a, b = cold.outputs[0].token_ids, warm.outputs[0].token_ids
            total += 1
            if a != b:
                differ.append(next(i for i, (x, y) in enumerate(zip(a, b, strict=True)) if x != y))
    where = f"; first differing token: median {statistics.median(differ):.0f}" if differ else ""
    what = f"{args.dtype}, temperature {args.temperature}, top_k {args.top_k}"
    print(f"{what}: {len(differ)} of {total} seeded requests differ cached vs not{where}")
    greedy = SamplingParams(temperature=0, max_tokens=args.max_tokens, ignore_eos=True)
    moved = 0
    for q in QUESTIONS:
        pool.reset_prefix_cache()
        cold, warm = (llm.generate(PREAMBLE + q, greedy)[0].outputs[0].token_ids for _ in range(2))
        moved += cold != warm
    print(f"{args.dtype}, greedy: {moved} of {len(QUESTIONS)} requests differ cached vs not")
    sampler_cost(llm)
    llm.close()
    figures = {"seeded_differ": len(differ), "seeded_total": total, "greedy_differ": moved}
    record("seeded_prefix_cache", {**figures, "dtype": args.dtype}, args=args)


def sampler_cost(llm) -> None:  # noqa: ANN001
    """Milliseconds per step of the sampler on 32 rows at temperature 1, unseeded against seeded."""
    import time

    import torch

    from tokenmill import SamplingParams
    from tokenmill.worker.request_state import CachedRequestState
    from tokenmill.worker.sampler import Sampler
    from tokenmill.worker.step import NewRequestData

    vocab = llm.tokenizer.vocab_size
    logits = torch.randn(32, vocab) * 3
    sampler = Sampler()
    for label, seed in (("unseeded", None), ("seeded", 1)):
        reqs = [
            CachedRequestState(
                NewRequestData(f"r{i}", [0], [], SamplingParams(temperature=1.0, seed=seed and i), [], [], 0)
            )
            for i in range(32)
        ]
        times = []
        for _ in range(30):
            t0 = time.perf_counter()
            sampler(logits, reqs)
            times.append(time.perf_counter() - t0)
        ms = statistics.median(times) * 1e3
        print(f"sampler, 32 rows of {vocab}, {label}: {ms:.2f} ms per step (median of 30)")


if __name__ == "__main__":
    main()
