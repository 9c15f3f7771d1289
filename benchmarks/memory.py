"""Resident memory of the engine by weight precision, against the layout of before in the same run.

Each configuration is built in a fresh process (the embedded model, a small KV pool so that the weights
show), answers one request, and reports its resident set from /proc/self/smaps split into the heap and
anonymous mappings (tensors), the weights' cache file still mapped, and libraries; beside it the bytes of
the tensors the model holds (its parameters, buffers and kernels' panels, oneDNN's packed weights
included). "before" is the layout of earlier sittings: oneDNN's copy of every linear kept beside the
panels (models/linear.py KEEP_ONEDNN_COPY) and the checkpoint's mapping left as the build leaves it
(models/own_weights.py off). "now" is the default.

    python benchmarks/memory.py [--only bf16,int8] [--kv-gb 0.1] [--model FILE.gguf]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from machine import cpu_description  # noqa: E402

CONFIGS = {
    "bf16": {},
    "int8": {"quantization": "int8"},
    "int8 groups": {"quantization": "int8", "int8_scales": "group"},
    "int4": {"quantization": "int4"},
    "fp8": {"quantization": "fp8"},
}

# Run in the child: build, answer, measure. argv: the LLM's keyword arguments as JSON, "before" or "now".
CHILD = r"""
import gc, json, sys
from collections import Counter
import torch
kw, layout = json.loads(sys.argv[1]), sys.argv[2]
if layout == "before":
    import tokenmill.models.linear as linear
    import tokenmill.models.registry as registry
    linear.KEEP_ONEDNN_COPY = True
    registry.own_remaining = lambda model, state_dict: 0
from tokenmill import LLM, SamplingParams
llm = LLM(**kw)
llm.generate(["The capital of France is"], SamplingParams(temperature=0, max_tokens=8))
gc.collect()
model = llm.engine.executor.worker.model
seen, held = set(), 0
def count(t):
    global held
    if not isinstance(t, torch.Tensor):
        return
    if t.is_mkldnn:  # oneDNN's packed weights: no storage to ask; their elements
        key, size = ("mkldnn", id(t)), t.numel() * t.element_size()
    else:
        key, size = t.untyped_storage().data_ptr(), t.untyped_storage().nbytes()
    if key not in seen:
        seen.add(key)
        held += size
def walk(obj, depth=0):
    for v in vars(obj).values():
        count(v)
        if depth < 2 and hasattr(v, "__dict__") and not isinstance(v, (torch.nn.Module, type)):
            walk(v, depth + 1)  # a kernel object's panels, scales, offsets
for m in model.modules():
    for t in list(m._parameters.values()) + list(m._buffers.values()):
        count(t)
    walk(m)
rss, name = Counter(), None
for line in open("/proc/self/smaps"):
    parts = line.split()
    if not (parts[0].endswith(":") and parts[0][0].isupper()):
        path = parts[5] if len(parts) > 5 else ""
        name = "heap+anon" if path in ("", "[heap]") or path.startswith("[anon") else (
            "weights file" if path.endswith((".safetensors", ".gguf")) else "other")
    elif parts[0] == "Rss:":
        rss[name] += int(parts[1]) * 1024
print("RESULT " + json.dumps({"rss": dict(rss), "held": held}))
"""


def run(kw: dict, layout: str) -> dict:
    out = subprocess.run(
        [sys.executable, "-c", CHILD, json.dumps(kw), layout], capture_output=True, text=True, check=True
    ).stdout
    (line,) = [x for x in out.splitlines() if x.startswith("RESULT ")]
    return json.loads(line.removeprefix("RESULT "))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--only", help="comma-separated precisions of the table")
    ap.add_argument("--kv-gb", type=float, default=0.1, help="the KV pool (small, so the weights show)")
    ap.add_argument("--model", help="another model than the embedded one (make_synthetic.py's, say)")
    args = ap.parse_args()
    names = list(CONFIGS) if args.only is None else [n.strip() for n in args.only.split(",")]
    print(f"CPU: {cpu_description()}; KV pool {args.kv_gb} GB (included in heap+anon)")
    columns = ["resident", "heap+anon", "weights file", "other", "tensors held"]
    print("| precision | layout | " + " | ".join(f"{c} MB" for c in columns) + " | now / before |")
    print("|---|---|---|---|---|---|---|---|")
    mb = 1 / 2**20
    for name in names:
        kw = {**CONFIGS[name], "kv_cache_memory_gb": args.kv_gb, "max_model_len": 4096}
        if args.model:  # a bigger model's KV: a context the small pool holds (1.7B: 544 tokens a 0.1 GB)
            kw.update(model=args.model, max_model_len=256)
        before = None
        for layout in ("before", "now"):
            r = run(kw, layout)
            total = sum(r["rss"].values())
            ratio = "" if before is None else f"{total / before:.2f}x"
            before = total if before is None else before
            parts = [total, *(r["rss"].get(c, 0) for c in columns[1:4]), r["held"]]
            print(
                f"| {name} | {layout} | " + " | ".join(f"{p * mb:.0f}" for p in parts) + f" | {ratio} |",
                flush=True,
            )


if __name__ == "__main__":
    main()
