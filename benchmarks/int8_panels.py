"""`quantization="int8"` (W8A8): the int8 panel kernel (kernels/csrc/panel_i8.cpp, vpdpbusd) against
oneDNN's u8 x s8 matmul, in one process. First all of SmolLM2-135M's 121 linears at a range of row counts
(each layer's activation quantization included, the same for both), beside the bf16 model's own
few-row kernel for scale; then the int8 model at 1 and 32 streams with the panel kernel switched on and
off, alternated. The panel kernel is used on AVX512-BF16 CPUs without AMX (models/ops.py,
int8_matmul_for), at every row count (256 a sweep), as the layers' only copy of the codes; this script
keeps oneDNN's beside it to compare. Elsewhere it says so and measures nothing.

    python benchmarks/int8_panels.py [--rows 1,2,4,8,16,32,64,128,256,512,2048] [--streams 1,32]
        [--rounds 2]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
from torch import nn

from tokenmill import LLM
from tokenmill.models import linear
from tokenmill.models.linear import Int8Linear, PackedLinear
from tokenmill.models.ops import get_ops

sys.path.insert(0, str(Path(__file__).resolve().parent))
from linear_kernels import SHAPES  # noqa: E402
from machine import cpu_description  # noqa: E402
from panel_matmul import alternate_in_model, linears_ms  # noqa: E402

INT8_BYTES = sum(o * i for o, i in SHAPES)


class Without(nn.Module):
    """An Int8Linear with its panel kernel switched off (oneDNN at every size)."""

    def __init__(self, layer: Int8Linear) -> None:
        super().__init__()
        self.layer = layer

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows, self.layer.small_rows = self.layer.small_rows, 0
        try:
            return self.layer(x)
        finally:
            self.layer.small_rows = rows


def microbenchmark(rows_list: list[int]) -> None:
    torch.manual_seed(0)
    ops = get_ops("cpu", "cpu")
    plain = [nn.Linear(i, o, bias=False).to(torch.bfloat16) for o, i in SHAPES]
    layers = [Int8Linear(m, ops.quantize_rows_u8, ops.scale_rows_, ops.int8_matmul_for) for m in plain]
    onednn = [Without(m) for m in layers]
    bf16 = [PackedLinear(m, ops.small_matmul_for(m.weight.detach())) for m in plain]
    limit = layers[0].small_rows or 1 << 62  # None: every row count
    print(f"\nAll 121 linears ({INT8_BYTES / 1e6:.0f} MB of int8 codes), best of 5, quantization included:\n")
    print("| rows | oneDNN int8 ms | int8 panels ms | oneDNN / panels | panels GB/s | bf16 kernel ms |")
    print("|---|---|---|---|---|---|")
    for rows in rows_list:
        if rows > limit:
            print(f"| {rows} | | | | | above the panel kernel's {limit} rows: oneDNN |")
            continue
        a, b, c = linears_ms(onednn, rows), linears_ms(layers, rows), linears_ms(bf16, rows)
        gbs = INT8_BYTES / b / 1e6
        print(f"| {rows} | {a:.2f} | {b:.2f} | {a / b:.2f}x | {gbs:.1f} | {c:.2f} |", flush=True)


def in_model(streams: list[int], rounds: int) -> None:
    llm = LLM(max_num_seqs=max(streams), enable_prefix_caching=False, quantization="int8")
    layers = [m for m in llm.engine.executor.worker.model.modules() if isinstance(m, Int8Linear)]
    limits = [m.small_rows for m in layers]

    def use(kernel: bool) -> None:
        for m, limit in zip(layers, limits, strict=True):
            assert not m.sole, "oneDNN's copy is kept (KEEP_ONEDNN_COPY) before the model is built"
            m.small_rows = limit if kernel else 0

    alternate_in_model(llm, streams, rounds, use, ("oneDNN int8", "int8 panels"))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", default="1,2,4,8,16,32,64,128,256,512,2048")
    ap.add_argument("--streams", default="1,32")
    ap.add_argument("--rounds", type=int, default=2)
    args = ap.parse_args()
    linear.KEEP_ONEDNN_COPY = True  # oneDNN's copy kept beside the panels, to switch to
    print(f"CPU: {cpu_description()}; torch threads {torch.get_num_threads()}")
    ops = get_ops("cpu", "cpu")
    if ops.int8_matmul_for(torch.zeros(32, 32, dtype=torch.int8), torch.ones(32)) is None:
        print("The int8 panel kernel is not used on this CPU (needs AVX512-BF16, no AMX): nothing measured.")
        return
    microbenchmark([int(r) for r in args.rows.split(",")])
    in_model([int(s) for s in args.streams.split(",")], args.rounds)


if __name__ == "__main__":
    main()
