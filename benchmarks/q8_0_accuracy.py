"""What computing with a Q8_0 GGUF's own codes would cost in accuracy, emulated: the question behind a
group-scale int8 kernel (issue #17), answered before writing one.

llama.cpp multiplies a Q8_0 file's weights (int8 codes, a float16 scale per group of 32) by activations
quantized the same way as a step runs (per row and group of 32: d = max|x| / 127, kept in float16,
q = round(x / d), halves away from zero). Emulated here in float32 on the plain-PyTorch path: the
file's weights, which float32 holds exactly, and every linear's input (the head's too) rounded to
those codes. Beside it, on the same text: the float32 and bf16 references of the embedded model, the
Q8_0 file's weights alone, and `quantization="int8"` (per-channel, smoothed) on the same file.

Then what tokenmill computes with the file: `quantization="int8"` in its group form (the default for a
Q8_0 file where the group panels run: the file's own codes, activations per group of 32, llama.cpp's
product) and in its per-channel form (the file dequantized, smoothed and quantized again).

    python benchmarks/q8_0_accuracy.py [--model FILE.gguf]

Without --model, the embedded file is written again in Q8_0 by weights/requantize.py (its Q4_1 weights
dequantized and quantized by the gguf package) into tokenmill's cache; `OUTTYPE=q8_0 bash
benchmarks/peers/make_bf16_gguf.sh` makes one with llama.cpp's converter from the bf16 HF export instead.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import torch
from torch import nn

from tokenmill import LLM
from tokenmill.models.linear import PackedLinear
from tokenmill.models.parallel_linear import ParallelLinear
from tokenmill.paths import default_cache_dir
from tokenmill.quality.perplexity import perplexity, text_version
from tokenmill.weights import catalog
from tokenmill.weights.requantize import requantize

sys.path.insert(0, str(Path(__file__).resolve().parent))
from machine import cpu_description  # noqa: E402

COMMON = {"max_model_len": 512, "kv_cache_memory_gb": 0.2, "enable_prefix_caching": False}
GROUP = 32


def q8_0_rows(x: torch.Tensor) -> torch.Tensor:
    """x as llama.cpp's Q8_0 activation blocks hold it: per row and group of 32, codes times a float16
    scale."""
    g = x.float().reshape(-1, x.shape[-1] // GROUP, GROUP)
    d = g.abs().amax(-1, keepdim=True) / 127
    scaled = g * torch.where(d > 0, 1 / d, torch.zeros_like(d))
    q = torch.sign(scaled) * torch.floor(scaled.abs() + 0.5)
    return (q * d.half().float()).reshape(x.shape).to(x.dtype)


@contextmanager
def q8_0_activations() -> Iterator[None]:
    """Every linear's input rounded to Q8_0 while a model is built and run (patched on the classes, as
    the model takes its layers' bound calls at build; a bf16 model's linears are PackedLinear)."""
    originals: dict[type, Callable] = {cls: cls.forward for cls in (ParallelLinear, PackedLinear, nn.Linear)}
    for cls, f in originals.items():
        cls.forward = lambda self, x, f=f: f(self, q8_0_rows(x))  # type: ignore[method-assign]
    try:
        yield
    finally:
        for cls, f in originals.items():
            cls.forward = f  # type: ignore[method-assign]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", help="a Q8_0 GGUF of the embedded model's weights (default: written here)")
    args = ap.parse_args()
    if args.model is None:
        made = default_cache_dir() / "requantized" / "smollm2-135m-q8_0.gguf"
        if not made.is_file():
            made.parent.mkdir(parents=True, exist_ok=True)
            requantize(catalog.resolve("smollm2-135m"), made)
        args.model = str(made)
    if not Path(args.model).is_file():
        sys.exit(f"error: no GGUF at {args.model}")
    exact = {"dtype": "float32", "kernels": "torch"}
    rows = [
        ("float32, embedded Q4_1 file (the reference)", False, exact),
        ("bf16 (default), embedded file", False, {}),
        ("float32, the Q8_0 file's weights", False, {"model": args.model, **exact}),
        ("float32, Q8_0 weights x Q8_0 activations (llama.cpp's product, emulated)", True,
         {"model": args.model, **exact}),
        ("quantization=int8, group form (the file's own codes; int8_scales=auto)", False,
         {"model": args.model, "quantization": "int8"}),
        ("quantization=int8, per channel, smoothed (int8_scales=channel), the Q8_0 file", False,
         {"model": args.model, "quantization": "int8", "int8_scales": "channel"}),
    ]  # fmt: skip
    print(f"CPU: {cpu_description()}; text: {text_version()}")
    print("| configuration | perplexity | vs float32 | vs bf16 |\n|---|---|---|---|")
    values: list[float] = []
    for label, emulate, kw in rows:
        if emulate:
            with q8_0_activations():
                value = perplexity(LLM(**COMMON, **kw)).value
        else:
            llm = LLM(**COMMON, **kw)
            auto = kw.get("quantization") == "int8" and "int8_scales" not in kw
            if auto and not llm.engine.executor.worker.model.quant.groups:
                label += " [per channel here: no group panels on this CPU]"
            value = perplexity(llm).value
            del llm
        values.append(value)
        print(f"| {label} | {value:.4f} | {value / values[0] - 1:+.2%} | {value / values[1] - 1:+.2%} |"
              if len(values) > 1 else f"| {label} | {value:.4f} | +0.00% | - |", flush=True)  # fmt: skip


if __name__ == "__main__":
    main()
