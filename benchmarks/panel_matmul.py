"""The panel matmul of decode steps (kernels/csrc/panel_matmul.cpp) against oneDNN's packed matmul, in
one process: first all of SmolLM2-135M's 121 linears at a range of row counts, then the model itself
at 1 and 32 streams with every packed linear's few-row kernel switched on and off, alternated. Which
loops the panel kernel runs depends on the CPU (models/ops.py, PanelMatmul): vector loops and brgemm
with AMX, dot loops (vdpbf16ps) with AVX512-BF16 and no AMX (every row count, 256 a sweep: there the
panels are a model's only copy of the weights, and this script keeps oneDNN's beside them to compare),
vector loops alone elsewhere.

    python benchmarks/panel_matmul.py [--rows 1,2,4,8,16,32,64,96,128,256,512,2048] [--streams 1,32]
        [--rounds 2] [--llama8b | --shape smollm2-1.7b]
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch
from torch import nn

from tokenmill import LLM, SamplingParams
from tokenmill.models import linear
from tokenmill.models.linear import PackedLinear, amx_brgemm_available
from tokenmill.models.ops import get_ops

sys.path.insert(0, str(Path(__file__).resolve().parent))
from linear_kernels import SHAPES  # noqa: E402
from machine import cpu_description  # noqa: E402
from step_bytes import read_bandwidth_gbs  # noqa: E402
from step_flops import matmul_rate_gflops  # noqa: E402

# (out, in) of one Llama-3-8B layer's fused qkv, o, gate_up and down (--llama8b): a model whose K reaches
# 14336, where one sweep's 256 rows of x (7 MB) no longer stay in L2.
LLAMA8B_LAYER = [(6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336)]


def linears_ms(fns: list, rows: int, reps: int = 5, shapes: list[tuple[int, int]] = SHAPES) -> float:  # noqa: ANN001
    """Best of `reps` passes over all the linears (of `shapes`) at `rows` rows."""
    xs = {i: torch.randn(rows, i, dtype=torch.bfloat16) for i in {i for _, i in shapes}}
    for _ in range(2):
        for f, (_, i) in zip(fns, shapes, strict=True):
            f(xs[i])
    best = float("inf")
    for _ in range(reps):
        t = time.perf_counter()
        for f, (_, i) in zip(fns, shapes, strict=True):
            f(xs[i])
        best = min(best, time.perf_counter() - t)
    return best * 1e3


def layer_shapes(name: str) -> list[tuple[int, int]]:
    """(out, in) of one layer's fused qkv, o, gate_up and down for a shape of weights/synthetic.py."""
    from tokenmill.weights.synthetic import SHAPES as FAMILY

    s = FAMILY[name]
    qkv = (s.heads + 2 * s.kv_heads) * s.head_dim
    return [(qkv, s.hidden), (s.hidden, s.heads * s.head_dim), (2 * s.ffn, s.hidden), (s.hidden, s.ffn)]


def microbenchmark(rows_list: list[int], shapes: list[tuple[int, int]] = SHAPES, what: str = "") -> None:
    torch.manual_seed(0)
    ops = get_ops("cpu", "cpu")
    plain = [nn.Linear(i, o, bias=False).to(torch.bfloat16) for o, i in shapes]
    onednn = [PackedLinear(m) for m in plain]
    panels = [ops.small_matmul_for(m.weight.detach()) for m in plain]
    assert all(p is not None for p in panels)
    limit = panels[0].max_rows or 1 << 62  # type: ignore[union-attr]  # None: every row count
    weight_bytes = sum(2 * o * i for o, i in shapes)
    what = what or ("All 121 linears" if shapes is SHAPES else "One Llama-3-8B layer's 4 linears")
    # The roofline, measured here: a pass can be no faster than reading its weights once at the read
    # rate, nor than its multiply-adds at oneDNN's bf16 rate on a 2048 cube; "of limit" is the longer of
    # the two over the panel time (a kernel that waits for memory, then computes, gets their sum).
    read_gbs, bf16_gflops = read_bandwidth_gbs(), matmul_rate_gflops("bf16")
    print(f"\n{what} ({weight_bytes / 1e6:.0f} MB of bf16 weights), best of 5; read rate {read_gbs:.1f}")
    print(f"GB/s, bf16 matmul rate {bf16_gflops:.0f} GFLOP/s (oneDNN, 2048 cube):\n")
    # GB/s: the weights read once a pass (what bounds a few rows); GFLOP/s: 2 x rows x weights a pass
    # (what bounds many: the two cores' bf16 multiply-add rate).
    cols = ["rows", "oneDNN ms", "panel ms", "oneDNN / panel", "panel GB/s", "panel GFLOP/s", "limit ms"]
    print("| " + " | ".join([*cols, "of limit", "path"]) + " |")
    print("|---|---|---|---|---|---|---|---|---|")
    for rows in rows_list:
        if rows > limit:
            print(f"| {rows} | | | | | | above the panel kernel's {limit} rows: oneDNN |")
            continue
        a, b = linears_ms(onednn, rows, shapes=shapes), linears_ms(panels, rows, shapes=shapes)  # type: ignore[arg-type]
        small = panels[0]
        path = "dot loops" if small.dot else "vector loops" if rows <= small.vector_rows else "brgemm"  # type: ignore[union-attr]
        gbs, gflops = weight_bytes / b / 1e6, rows * weight_bytes / b / 1e6
        lim = max(weight_bytes / read_gbs / 1e6, rows * weight_bytes / bf16_gflops / 1e6)
        cells = f"{a:.2f} | {b:.2f} | {a / b:.2f}x | {gbs:.1f} | {gflops:.0f} | {lim:.2f} | {lim / b:.0%}"
        print(f"| {rows} | {cells} | {path} |", flush=True)


def alternate_in_model(
    llm: LLM, streams: list[int], rounds: int, use: Callable[[bool], None], names: tuple[str, str]
) -> None:
    """The model at each stream count with a kernel off and on (`use(False)`, `use(True)`), alternated:
    greedy, 64 tokens a stream, best of 3 per round; one table row per stream count."""
    params = SamplingParams(temperature=0, max_tokens=64, ignore_eos=True)
    off, on = names
    print("\nIn the model (greedy, 64 tokens a stream, best of 3 per round; rounds alternate the two):\n")
    print(f"| streams | {off} tok/s | {on} tok/s | {on} / {off} |")
    print("|---|---|---|---|")
    for n in streams:
        prompts = [f"Write a short story about a robot named R{i} who learns to paint." for i in range(n)]
        best = {False: 0.0, True: 0.0}
        for _ in range(rounds):
            for kernel in best:
                use(kernel)
                llm.generate(prompts[:2], params)  # warm-up: this path's shapes
                for _ in range(3):
                    t = time.perf_counter()
                    llm.generate(prompts, params)
                    best[kernel] = max(best[kernel], n * 64 / (time.perf_counter() - t))
        a, b = best[False], best[True]
        print(f"| {n} | {a:.1f} | {b:.1f} | {b / a:.2f}x |", flush=True)


def in_model(streams: list[int], rounds: int) -> None:
    llm = LLM(max_num_seqs=max(streams), enable_prefix_caching=False)
    packed = [m for m in llm.engine.executor.worker.model.modules() if isinstance(m, PackedLinear)]
    kernels = [m.small for m in packed]

    def use(kernel: bool) -> None:
        for m, k in zip(packed, kernels, strict=True):
            assert m.packed is not None, "oneDNN's copy is kept (KEEP_ONEDNN_COPY) before the model is built"
            m.small = k if kernel else None

    alternate_in_model(llm, streams, rounds, use, ("oneDNN", "panel"))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", default="1,2,4,8,16,32,64,96,128,256,512,2048")
    ap.add_argument("--streams", default="1,32")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--llama8b", action="store_true", help="one Llama-3-8B layer's shapes; no model part")
    ap.add_argument("--shape", help="one layer of a weights/synthetic.py shape (smollm2-1.7b); no model part")
    args = ap.parse_args()
    linear.KEEP_ONEDNN_COPY = True  # the model's linears keep oneDNN's copy to switch to
    cpu = cpu_description()
    dot = bool(get_ops("cpu", "cpu").k.panel_dot_available()) and not amx_brgemm_available()  # type: ignore[attr-defined]
    brgemm = amx_brgemm_available()
    print(f"CPU: {cpu}; torch threads {torch.get_num_threads()}; brgemm path: {brgemm}; dot loops: {dot}")
    if args.llama8b:
        microbenchmark([int(r) for r in args.rows.split(",")], LLAMA8B_LAYER)
        return
    if args.shape:
        shapes = layer_shapes(args.shape)
        microbenchmark([int(r) for r in args.rows.split(",")], shapes, f"One {args.shape} layer's 4 linears")
        return
    microbenchmark([int(r) for r in args.rows.split(",")])
    in_model([int(s) for s in args.streams.split(",")], args.rounds)


if __name__ == "__main__":
    main()
