"""Perplexity of each precision option on a fixed text (tokenmill/quality/perplexity.py: Python's own
documentation topics, shipped with CPython), against float32 and bf16 in the same run: what a
quantization costs in accuracy, beside what it buys in speed (docs/history/benchmarks.md).

    python benchmarks/perplexity.py [--chunks 32 --steps 128] [--model FILE] [--only int4 ...]

`--model`: another checkpoint (a Q4_0 or Q4_K_M GGUF, say: the int4 rows then compare the file's own
codes with the same weights quantized again); `--only`: just the rows whose label holds one of these
words, beside the float32 and bf16 rows the ratios need.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from tokenmill import LLM
from tokenmill.models.quant.int4 import Int4
from tokenmill.quality.perplexity import perplexity, text_version
from tokenmill.weights.loader import CheckpointCodes

sys.path.insert(0, str(Path(__file__).resolve().parent))
from machine import cpu_description  # noqa: E402
from results_log import add_flag, record  # noqa: E402

COMMON = {"max_model_len": 512, "kv_cache_memory_gb": 0.2, "enable_prefix_caching": False}
CONFIGS = [
    ("float32, plain PyTorch (the reference)", {"dtype": "float32", "kernels": "torch"}),
    ("bf16, plain PyTorch", {"kernels": "torch"}),
    ("bf16 (default)", {}),
    ("int8 weights and activations (quantization=int8, smoothed)", {"quantization": "int8"}),
    (
        "int8 weights and activations in groups of 32 (int8_scales=group, Q8_0's blocks)",
        {"quantization": "int8", "int8_scales": "group"},
    ),
    (
        "int8 weights and activations, unsmoothed (int8_smoothing=0)",
        {"quantization": "int8", "int8_smoothing": 0},
    ),
    (
        "int4 weights (quantization=int4: a 4-bit GGUF file's own codes), bf16 activations (W4A16)",
        {"quantization": "int4", "int4_activations": "bf16"},
    ),
    (
        "int4 weights requantized from bf16 (as from a Hugging Face directory)",
        {"quantization": "int4", "requantize": True},
    ),
    (
        "int4 weights, int8 activations above 2 rows (int4_activations=int8, the default: W4A8)",
        {"quantization": "int4", "int4_activations": "int8"},
    ),
    (
        "int4 weights, int8 activations above 2 rows, the 8-bit head per channel (before the 23rd sitting)",
        {"quantization": "int4", "int4_activations": "int8", "head_per_channel": True},
    ),
    ("fp8 e4m3 weights and activations, emulated (quantization=fp8)", {"quantization": "fp8"}),
    ("bf16, int8 KV cache (kv_cache_dtype=int8)", {"kv_cache_dtype": "int8"}),
    ("bf16, fp8 e4m3 KV cache (kv_cache_dtype=fp8)", {"kv_cache_dtype": "fp8"}),
]
# The rows benchmarks/goals.toml judges, by the stable names of their figures (percent against bf16).
METRICS = {
    "int8 weights and activations (quantization=int8, smoothed)": "int8_ppl_pct",
    "int8 weights and activations in groups of 32 (int8_scales=group, Q8_0's blocks)": "int8_groups_ppl_pct",
    "int4 weights (quantization=int4: a 4-bit GGUF file's own codes), bf16 activations (W4A16)": (
        "int4_w4a16_ppl_pct"
    ),
    "int4 weights, int8 activations above 2 rows (int4_activations=int8, the default: W4A8)": "int4_ppl_pct",
    "fp8 e4m3 weights and activations, emulated (quantization=fp8)": "fp8_ppl_pct",
    "bf16, int8 KV cache (kv_cache_dtype=int8)": "kv_int8_ppl_pct",
    "bf16, fp8 e4m3 KV cache (kv_cache_dtype=fp8)": "kv_fp8_ppl_pct",
}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--chunks", type=int, default=32)
    ap.add_argument("--steps", type=int, default=128)
    ap.add_argument("--model", default=None, help="a GGUF file or HF directory (default: the embedded model)")
    ap.add_argument("--only", nargs="*", default=None, help="rows whose label contains one of these")
    add_flag(ap)
    args = ap.parse_args()
    model = {"model": args.model} if args.model else {}
    base_rows = ("float32, plain PyTorch (the reference)", "bf16 (default)")
    print(f"CPU: {cpu_description()}; text: {text_version()}; {args.chunks} chunks x {args.steps} tokens")
    print(f"model: {args.model or 'the embedded SmolLM2-135M-Instruct Q4_1 GGUF'}")
    print("| configuration | perplexity | vs float32 | vs bf16 default |")
    print("|---|---|---|---|")
    base: dict[str, float] = {}
    figures: dict[str, float | str | None] = {"model": args.model}
    for label, kw in CONFIGS:
        if args.only and label not in base_rows and not any(w in label for w in args.only):
            continue
        kw = dict(kw)
        # The engine reads a GGUF file's 4-bit codes as they are; this row quantizes the bf16 weights
        # again instead, as it must for a checkpoint without codes (in-process worker: patched here).
        requantize = kw.pop("requantize", False)
        # The int4 head as it was before it took int8's group form (the per-channel 8-bit panels, exact
        # products): patched the same way.
        head_per_channel = kw.pop("head_per_channel", False)
        saved = CheckpointCodes.int4
        if requantize:
            CheckpointCodes.int4 = lambda self: None  # type: ignore[method-assign]
        Int4.head_in_groups = not head_per_channel
        try:
            llm = LLM(**{"dtype": "bfloat16", **kw, **COMMON, **model})
        finally:
            CheckpointCodes.int4, Int4.head_in_groups = saved, True  # type: ignore[method-assign]
        p = perplexity(llm, args.chunks, steps=args.steps)
        # A CPU without the group kernels quantizes per channel instead (the engine says so): that row's
        # figure is then not the group form's and is left out of the results log.
        took = (
            getattr(llm.engine.executor.worker.model.quant, "groups", True)
            or kw.get("int8_scales") != "group"
        )
        del llm
        base.setdefault("f32", p.value)
        if label == "bf16 (default)":
            base["bf16"] = p.value
        vs_bf16 = f"{100 * (p.value / base['bf16'] - 1):+.2f}%" if "bf16" in base else "-"
        vs_f32 = f"{100 * (p.value / base['f32'] - 1):+.2f}%"
        print(f"| {label} | {p.value:.4f} | {vs_f32} | {vs_bf16} |", flush=True)
        if label in METRICS and "bf16" in base and took:
            figures[METRICS[label]] = round(100 * (p.value / base["bf16"] - 1), 3)
    record("perplexity", figures, args=args)


if __name__ == "__main__":
    main()
