"""Linear-layer kernels on this CPU: time for all of SmolLM2-135M's matmuls at several row counts, each
precision's layers built as the model builds them (the fused ops' kernels, the output head included),
against bf16 in the same run.

- bf16: PackedLinear: oneDNN-packed linears with their few-row panel kernel, or on AVX512-BF16 CPUs
  without AMX the panels alone at every row count.
- int4: QuantizedLinear, 4-bit layers and an 8-bit head; with the 4-bit panels (AVX512-BF16 without
  AMX) at every row count, bf16 activations (W4A16), and the head in the group panels with 16-bit
  activation codes (GroupInt8Linear, as models/llama.py builds it there); elsewhere PyTorch's int4 and
  int8 matmuls up to 4 rows and a bf16 copy above.
- int4a8: the same with int4_activations="int8" (W4A8 above 2 rows, where the 4-bit panels run).
- q4_0a8: int4a8 with a Q4_0 file's codes (the `gguf` package's quantizer; w = (q - 8) scale), which
  the 4-bit panels hold without minima: 4.5 bits a weight rather than 5.
- int8: Int8Linear (W8A8, per channel and row).
- int8g: GroupInt8Linear (W8A8 in groups of 32 on both sides, Q8_0's blocks), where its panels run.

A decode step of M streams runs these matmuls at M rows; a prompt chunk at its token count.

    python benchmarks/linear_kernels.py [--rows 1,4,8,32,64,256,512] [--reps 5] [--head]

`--head`: the output head alone (49152 x 576): bf16 is then what int4's 8-bit head used to run above 4
rows (its dequantized copy, packed as a bf16 linear is), int4ch the per-channel 8-bit panels (Q8Panels,
exact products) it ran before the twenty-third sitting, int4 the group panels with 16-bit activation codes
it runs now, int8g the same panels with 8-bit codes.
`--shape NAME --layers N`: N layers and the head of a weights/synthetic.py shape (smollm2-1.7b) instead;
the GB/s columns are the weights each kernel reads a sweep over its time (what bounds a few rows).
"""

from __future__ import annotations

import argparse
import functools
import sys
import time
from pathlib import Path

import gguf
import torch
from gguf import GGMLQuantizationType
from torch import nn

from tokenmill.models.linear import GroupInt8Linear, Int8Linear, PackedLinear, QuantizedLinear
from tokenmill.models.ops import get_ops
from tokenmill.weights.group_codes import GroupCodes, codes_from_blocks

sys.path.insert(0, str(Path(__file__).resolve().parent))
from machine import cpu_description  # noqa: E402
from step_bytes import weight_bytes  # noqa: E402

# (out, in) of one SmolLM2 layer's fused qkv, o, gate_up, down; 30 layers; then the output head.
VOCAB = 49152  # the family's tokenizer: the output head's rows
SHAPES = [(960, 576), (576, 576), (3072, 576), (576, 1536)] * 30 + [(VOCAB, 576)]


def q4_0_codes(w: torch.Tensor) -> GroupCodes:
    """A weight's codes as a Q4_0 GGUF tensor holds them (the `gguf` package's quantizer)."""
    blocks = gguf.quants.quantize(w.detach().float().numpy(), GGMLQuantizationType.Q4_0)
    return codes_from_blocks(blocks, GGMLQuantizationType.Q4_0, *w.shape)


def time_ms(mods: list[nn.Module], shapes: list[tuple[int, int]], rows: int, reps: int) -> float:
    """The best of `reps` sweeps through every layer (each layer's input freshly random per sweep would
    cost more than the small matmuls; one input per width is reused)."""
    xs = {i: torch.randn(rows, i, dtype=torch.bfloat16) for i in {i for _, i in shapes}}
    for m, (_, i) in zip(mods, shapes, strict=True):
        m(xs[i])
    best = float("inf")
    for _ in range(reps):
        t0 = time.perf_counter()
        for m, (_, i) in zip(mods, shapes, strict=True):
            m(xs[i])
        best = min(best, time.perf_counter() - t0)
    return best * 1e3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", default="1,4,5,8,16,32,64,128,256,512")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--head", action="store_true", help="the output head alone")
    ap.add_argument("--shape", help="a weights/synthetic.py shape's layers and head (smollm2-1.7b)")
    ap.add_argument("--layers", type=int, default=4, help="with --shape: how many of its layers")
    args = ap.parse_args()
    shapes = SHAPES
    if args.shape:
        from panel_matmul import layer_shapes

        layer = layer_shapes(args.shape)
        hidden = layer[0][1]  # the qkv projection's input
        shapes = layer * args.layers + [(VOCAB, hidden)]
    if args.head:
        shapes = shapes[-1:]
    print(cpu_description(), f"; {args.shape or 'smollm2-135m'}: {len(shapes)} matmuls")
    ops = get_ops("cpu", "cpu")
    torch.manual_seed(0)
    plain = [nn.Linear(i, o, bias=False).to(torch.bfloat16) for o, i in shapes]
    quant_a8 = functools.partial(ops.quantized_matmul_for, int8_activations=True)
    wide = functools.partial(ops.group_int8_matmul_for, wide_rows=2**62)

    def per_channel(m: nn.Linear) -> nn.Module:  # int4's 8-bit head before the twenty-third sitting
        return QuantizedLinear(m, 8, 4, ops.quantized_matmul_for, ops.small_matmul_for)

    def head(m: nn.Linear) -> nn.Module:
        """int4's 8-bit head as models/llama.py builds it: the group panels with 16-bit activation codes
        where they run, else the per-channel 8-bit layer."""
        return GroupInt8Linear.of(m, wide) or per_channel(m)

    def int4(m: nn.Linear, out: int, quant_for: object, codes: GroupCodes | None = None) -> nn.Module:
        return head(m) if out == VOCAB else QuantizedLinear(m, 4, 4, quant_for, ops.small_matmul_for, codes)

    configs: dict[str, list[nn.Module]] = {
        "bf16": [PackedLinear(m, ops.small_matmul_for(m.weight.detach())) for m in plain],
        "int4": [int4(m, o, ops.quantized_matmul_for) for m, (o, _) in zip(plain, shapes, strict=True)],
    }
    if args.head:  # the head as int4 built it before
        configs["int4ch"] = [per_channel(m) for m in plain]
    else:
        configs["int4a8"] = [int4(m, o, quant_a8) for m, (o, _) in zip(plain, shapes, strict=True)]
    configs["int8"] = [
        Int8Linear(m, ops.quantize_rows_u8, ops.scale_rows_, ops.int8_matmul_for) for m in plain
    ]
    if not args.head:
        configs["q4_0a8"] = [
            int4(m, o, quant_a8, None if o == VOCAB else q4_0_codes(m.weight))
            for m, (o, _) in zip(plain, shapes, strict=True)
        ]
    groups = [GroupInt8Linear.of(m, ops.group_int8_matmul_for) for m in plain]
    if all(g is not None for g in groups):  # where the group panels run
        configs["int8g"] = groups  # type: ignore[assignment]
    for label, layer in (("int4 layers", configs["int4"][0]), ("int4's 8-bit head", configs["int4"][-1])):
        rows = getattr(layer, "max_rows", None)
        path = "panels at every row count" if rows is None else "bf16 copy above 4 rows"
        print(f"{label}: {type(layer).__name__}, {path}")
    names = list(configs)
    sizes = {n: weight_bytes(nn.ModuleList(configs[n]), 1) for n in names}  # what one row reads
    header = " ".join(f"{n + ' ms':>9}" for n in names) + " " + " ".join(f"{n:>6}" for n in names[1:])
    print(f"weights a sweep, MB: {', '.join(f'{n} {b / 1e6:.0f}' for n, b in sizes.items())}")
    print(f"{'rows':>5} {header} " + " ".join(f"{n + ' GB/s':>10}" for n in names))
    with torch.inference_mode():
        for rows in (int(r) for r in args.rows.split(",")):
            ms = [time_ms(configs[n], shapes, rows, args.reps) for n in names]
            ratios = " ".join(f"{ms[0] / t:5.2f}x" for t in ms[1:])
            rates = " ".join(f"{sizes[n] / t / 1e6:10.1f}" for n, t in zip(names, ms, strict=True))
            print(f"{rows:5d} " + " ".join(f"{t:9.2f}" for t in ms) + " " + ratios + " " + rates)


if __name__ == "__main__":
    main()
