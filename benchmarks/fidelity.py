"""How closely each engine configuration tracks float32: teacher-forced next-token distributions.

Every configuration is fed the float32 model's greedy continuation of 16 chat prompts (48 tokens
each, decoded as one batch), and each position's distribution is compared with float32's: top-1
agreement, mean and max KL(float32 || configuration). Also the free-running figure that misleads
(greedy tokens equal to float32's before the first divergence, summed over the prompts): one near-tie
early in a sequence changes everything after it.

    python benchmarks/fidelity.py [--steps 48] [--levels]    # --levels: every ISA build of the kernels
"""

from __future__ import annotations

import argparse

from tokenmill import LLM
from tokenmill.kernels.isa import cpu_summary, get_level, level_names
from tokenmill.quality.fidelity import compare, forced_run
from tokenmill.quality.prompts import chat_prompts

COMMON = {"max_model_len": 512, "kv_cache_memory_gb": 0.1, "enable_prefix_caching": False}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=48)
    ap.add_argument("--levels", action="store_true", help="also each ISA build of the C++ kernels")
    args = ap.parse_args()
    ref_llm = LLM(dtype="float32", kernels="torch", **COMMON)
    prompts = chat_prompts(ref_llm.tokenizer)
    ref = forced_run(ref_llm, prompts, args.steps)
    del ref_llm
    configs: list[tuple[str, dict]] = [
        ("bf16, plain PyTorch (kernels=torch)", {"kernels": "torch"}),
        ("bf16, default (kernels=auto)", {"kernels": "auto"}),
    ]
    if args.levels:
        configs += [
            (f"bf16, C++ kernels {name}", {"kernels": name})
            for name in level_names()
            if get_level(name).supported()
        ]
    configs.append(("int4 weights (quantization=int4)", {"quantization": "int4"}))
    print(f"CPU: {cpu_summary()}; {len(prompts)} prompts x {args.steps} positions")
    print("| configuration | top-1 agreement | mean KL (nats) | max KL | greedy tokens before divergence |")
    print("|---|---|---|---|---|")
    for label, kw in configs:
        llm = LLM(dtype="bfloat16", **kw, **COMMON)
        f = compare(ref, forced_run(llm, prompts, args.steps, ref), forced_run(llm, prompts, args.steps))
        del llm
        print(
            f"| {label} | {f.top1_agreement:.4f} | {f.mean_kl:.6f} | {f.max_kl:.4f} | "
            f"{f.greedy_prefix_tokens} / {f.positions} |",
            flush=True,
        )


if __name__ == "__main__":
    main()
