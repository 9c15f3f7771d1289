"""Prompt attention: the whole-prompt brgemm kernel against PyTorch's SDPA (the reference backend's path).

SmolLM2-135M's shape (9 query heads, 3 kv heads, head size 64), bf16, one layer of a prompt step: a
2048-token step made of whole prompts, as offline serving schedules them. Cases: the offline
benchmark's prompts (32-512 tokens, uniform), and single prompts of 128 to 1024 tokens. Both paths
run in the same process, alternated, best of three rounds; GFLOPS counts the causal products only
(2 * 2 * D flops for each query-key pair a query sees).

    python benchmarks/prefill_attention.py
"""

from __future__ import annotations

import random
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from machine import cpu_description  # noqa: E402

from tokenmill.models.attention.backend import PrefillSegment  # noqa: E402
from tokenmill.models.attention.cpu_paged import brgemm_prefill_available  # noqa: E402
from tokenmill.models.attention.registry import get_backend  # noqa: E402

H, HKV, D, STEP = 9, 3, 64, 2048


def offline_lengths(rng: random.Random) -> list[int]:
    """Prompts of 32-512 tokens until the next would overflow a 2048-token step."""
    lens: list[int] = []
    while True:
        n = rng.randint(32, 512)
        if sum(lens) + n > STEP:
            return lens
        lens.append(n)


def time_ms(fn, reps: int) -> float:
    fn()
    t0 = time.perf_counter()
    for _ in range(reps):
        fn()
    return (time.perf_counter() - t0) / reps * 1e3


def main() -> None:
    print(cpu_description(), f"threads: {torch.get_num_threads()}")
    if not brgemm_prefill_available():
        print("the whole-prompt kernel does not run on this CPU (it needs AMX); nothing to compare")
        return
    rng = random.Random(0)
    cases = [("offline mix", offline_lengths(rng)), ("offline mix", offline_lengths(rng))]
    cases += [(f"1 x {n}", [n]) for n in (128, 256, 512, 1024)]
    backends = {"ref": get_backend("torch"), "cpu": get_backend("cpu")}
    print("| prompts | tokens | SDPA ms | kernel ms | SDPA GFLOPS | kernel GFLOPS | speed-up |")
    print("|---|---|---|---|---|---|---|")
    g = torch.Generator().manual_seed(0)
    for name, lens in cases:
        t = sum(lens)
        qkv = torch.randn(t, (H + 2 * HKV) * D, generator=g).to(torch.bfloat16)
        q = qkv[:, : H * D].view(t, H, D)
        k = qkv[:, H * D : (H + HKV) * D].view(t, HKV, D)
        v = qkv[:, (H + HKV) * D :].view(t, HKV, D)
        segs, start = [], 0
        for n in lens:
            segs.append(PrefillSegment(start, n, 0, torch.zeros(0, dtype=torch.long)))
            start += n
        outs = {w: torch.empty(t, H, D, dtype=torch.bfloat16) for w in backends}

        def run(which: str, segs=segs, q=q, k=k, v=v, outs=outs) -> None:
            backends[which]._prefill(q, k, v, None, None, segs, D**-0.5, outs[which])

        run("ref")
        run("cpu")
        torch.testing.assert_close(outs["cpu"].float(), outs["ref"].float(), atol=2e-2, rtol=2e-2)
        best = {w: float("inf") for w in backends}
        for _ in range(3):
            for w in backends:
                best[w] = min(best[w], time_ms(lambda w=w: run(w), 5))
        flops = sum(4 * D * H * n * (n + 1) / 2 for n in lens)
        ref, cpu = best["ref"], best["cpu"]
        print(
            f"| {name} ({len(lens)}) | {t} | {ref:.2f} | {cpu:.2f} "
            f"| {flops / ref / 1e6:.0f} | {flops / cpu / 1e6:.0f} | {ref / cpu:.2f} |"
        )


if __name__ == "__main__":
    main()
