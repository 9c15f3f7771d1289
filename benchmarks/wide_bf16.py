"""bf16 weights computed in float32 (dtype "auto" on CPUs without BF16 instructions) against bf16
arithmetic (dtype "bfloat16"), same run, same machine: offline tokens/s at one stream and at 32, and a
512-token prompt's prefill.

    python benchmarks/wide_bf16.py [--emulate-avx2] [--rounds 2] [--quantization int4] [--json out.json]
    python benchmarks/wide_bf16.py --emulate-avx2 --kernel   # the matmul alone, against PyTorch's

`--emulate-avx2` holds oneDNN, ATen, MKL and tokenmill's kernels to AVX2 (as `make test`'s AVX2 pass
does), so that an AVX-512 machine takes an AVX2-only CPU's paths; the figures then say so. Each setting
runs in a fresh process (the limits are read at start), settings alternating, `--rounds` times each; the
report gives every round and the medians.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from machine import cpu_description  # noqa: E402
from results_log import add_flag, record  # noqa: E402

AVX2_ENV = {
    "TOKENMILL_MAX_ISA": "avx2",
    "ONEDNN_MAX_CPU_ISA": "AVX2",
    "ATEN_CPU_CAPABILITY": "avx2",
    "MKL_ENABLE_INSTRUCTIONS": "AVX2",
}
SETTINGS = {"bf16 arithmetic (dtype bfloat16)": "bfloat16", "float32 arithmetic (dtype auto)": "auto"}

CHILD = r"""
import json, random, sys, time
from tokenmill import LLM, SamplingParams
quantization = sys.argv[2] or None
llm = LLM(dtype=sys.argv[1], quantization=quantization, max_model_len=1024, enable_prefix_caching=False)
worker = llm.engine.executor.worker
rng = random.Random(0)
vocab = llm.engine.model_config.vocab_size
prompts = [[rng.randrange(100, vocab) for _ in range(32)] for _ in range(32)]
sp = SamplingParams(temperature=0, max_tokens=64, ignore_eos=True)
llm.generate(prompts[:4], [sp] * 4, use_tqdm=False)  # warm-up: kernels, allocator, step shapes
t = time.perf_counter()
for p in prompts[:3]:
    llm.generate([p], [sp], use_tqdm=False)
one = 3 * 64 / (time.perf_counter() - t)
t = time.perf_counter()
outs = llm.generate(prompts, [sp] * 32, use_tqdm=False)
batch = 32 * 64 / (time.perf_counter() - t)
long = [rng.randrange(100, vocab) for _ in range(512)]
first = SamplingParams(temperature=0, max_tokens=1)
llm.generate([long[::-1]], [first], use_tqdm=False)
t = time.perf_counter()
llm.generate([long], [first], use_tqdm=False)
prefill = time.perf_counter() - t
print("RESULT " + json.dumps({
    "arithmetic": str(worker.dtype).removeprefix("torch."),
    "one_stream_tok_s": one, "batch32_tok_s": batch, "prefill512_s": prefill,
    "first_tokens": outs[0].outputs[0].token_ids[:16],
}))
"""


KERNEL = r"""
import time, torch
from tokenmill.kernels import cpu_kernels
from tokenmill.kernels.isa import best_level
k = cpu_kernels(best_level().name)
# SmolLM2-135M: a layer's four linears (qkv, gate_up, down, o) and the output head
shapes = [(960, 576), (3072, 576), (576, 1536), (576, 576), (49152, 576)]
def best(f, n=5):
    f()
    times = []
    for _ in range(n):
        t = time.perf_counter(); f(); times.append(time.perf_counter() - t)
    return min(times) * 1e3
g = torch.Generator().manual_seed(0)
print(f"kernels {k.isa_level()}; ms for the five shapes, best of 5")
from tokenmill.models.ops import g8_pack
from tokenmill.weights.group_codes import quantize_int8_groups
for m in (1, 4, 32, 256):
    wide = bf16 = f32 = g8 = 0.0
    for n, kk in shapes:
        w = torch.randn(n, kk, generator=g).bfloat16()
        p, wf, x = k.panel_pack(w), w.float(), torch.randn(m, kk, generator=g)
        codes = quantize_int8_groups(w)
        p8 = g8_pack(codes.q, codes.scale)
        wide += best(lambda: k.panel_matmul_wide(x, p, n))
        bf16 += best(lambda: torch.nn.functional.linear(x.bfloat16(), w))
        f32 += best(lambda: torch.nn.functional.linear(x, wf))
        if k.g8_wide_available():
            g8 += best(lambda: k.g8_matmul_wide(x, p8, n))
    print(f"{m:4d} rows: widened bf16 panels {wide:7.2f}  PyTorch bf16 {bf16:7.2f} ({bf16 / wide:.1f}x)  "
          f"PyTorch float32 {f32:7.2f} ({f32 / wide:.2f}x)  int8 groups by the AVX2 loops {g8:7.2f} "
          f"({wide / g8 if g8 else float('nan'):.2f}x of widened)", flush=True)
"""


def run(dtype: str, quantization: str, env: dict[str, str]) -> dict:
    r = subprocess.run(
        [sys.executable, "-c", CHILD, dtype, quantization],
        env={**os.environ, **env},
        capture_output=True,
        text=True,
        check=False,
    )
    line = next((ln for ln in r.stdout.splitlines() if ln.startswith("RESULT ")), None)
    if r.returncode != 0 or line is None:
        raise SystemExit(f"the {dtype} run failed:\n{r.stderr[-2000:]}")
    return json.loads(line[len("RESULT ") :])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--emulate-avx2", action="store_true", help="hold every library to AVX2 (see above)")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--json", help="write the figures to this file")
    ap.add_argument("--kernel", action="store_true", help="time the matmul alone against PyTorch's")
    ap.add_argument("--quantization", default="", help='e.g. "int4": both settings quantized so')
    add_flag(ap)
    args = ap.parse_args()
    env = AVX2_ENV if args.emulate_avx2 else {}
    print(f"CPU: {cpu_description()}" + (" (held to AVX2)" if args.emulate_avx2 else ""))
    if args.kernel:
        subprocess.run([sys.executable, "-c", KERNEL], env={**os.environ, **env}, check=True)
        return
    runs: dict[str, list[dict]] = {name: [] for name in SETTINGS}
    for i in range(args.rounds):
        for name, dtype in SETTINGS.items():
            r = run(dtype, args.quantization, env)
            runs[name].append(r)
            print(
                f"round {i + 1} {name:34s} [{r['arithmetic']}]: 1 stream {r['one_stream_tok_s']:6.1f} tok/s, "
                f"32 streams {r['batch32_tok_s']:6.1f} tok/s, 512-token prefill {r['prefill512_s']:.2f} s",
                flush=True,
            )
    med = {
        name: {
            k: statistics.median(r[k] for r in rs)
            for k in ("one_stream_tok_s", "batch32_tok_s", "prefill512_s")
        }
        for name, rs in runs.items()
    }
    base, new = (med[n] for n in SETTINGS)
    one = new["one_stream_tok_s"] / base["one_stream_tok_s"]
    print(
        f"float32 arithmetic / bf16 arithmetic (medians): 1 stream {one:.2f}x, "
        f"32 streams {new['batch32_tok_s'] / base['batch32_tok_s']:.2f}x, "
        f"prefill {base['prefill512_s'] / new['prefill512_s']:.2f}x faster"
    )
    stable = all(all(r["first_tokens"] == rs[0]["first_tokens"] for r in rs) for rs in runs.values())
    verdict = "the same" if stable else "differ"
    print(f"greedy tokens of the first request, each setting's rounds: {verdict}")
    figures = {f"bf16_{k}": v for k, v in base.items()} | new
    figures |= {"prefill512_speedup": base["prefill512_s"] / new["prefill512_s"], "one_stream_speedup": one}
    figures |= {"quantization": args.quantization or "none", "rounds": args.rounds}
    record("wide_bf16", figures, args=args, max_isa="avx2" if args.emulate_avx2 else None)
    if args.json:
        Path(args.json).write_text(
            json.dumps({"cpu": cpu_description(), "args": vars(args), "runs": runs}, indent=1)
        )


if __name__ == "__main__":
    main()
