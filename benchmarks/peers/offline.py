"""Offline throughput, tokenmill's `LLM.generate` against vLLM's (CPU build), on the same requests.

The workload of benchmarks/offline_throughput.py: 256 requests of random token ids, prompts of 32-512
tokens and 16-256 output tokens each (uniform, fixed seed), greedy, `ignore_eos` so every request
makes exactly its length. Each engine runs in its own process, one after the other (vLLM from its
venv, set up by setup_vllm.sh, on the HF directory from export_hf.py); tokens per second counts prompt
and output tokens, and output tokens alone. Each time is then set against two floors measured on this
machine after the runs: the workload's arithmetic at the bf16 matmul rate, and decode attention's KV
reads at the read bandwidth (step_flops.py, step_bytes.py).

    python benchmarks/peers/offline.py [--num-requests 256] [--engines tokenmill,tokenmill-int8,vllm]
        [--kv-cache-memory-gb 4] [--model FILE.gguf --hf-dir DIR]

--model and --hf-dir put another model in place of the embedded one (the same weights twice: a GGUF for
tokenmill, its bf16 export for vLLM; make_synthetic.py makes both for bigger shapes).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
from machine import cpu_description  # noqa: E402
from results_log import add_flag, record  # noqa: E402
from step_bytes import read_bandwidth_gbs  # noqa: E402
from step_flops import flop, matmul_rate_gflops  # noqa: E402

from tokenmill.sizing.arch import Arch, resolve  # noqa: E402

PEERS = Path(os.environ.get("PEERS_DIR", Path.home() / ".cache" / "tokenmill-peers"))

# Run inside each engine's own interpreter: reads the workload, prints one JSON line.
RUNNER = r"""
import json, sys, time
engine, path, hf_dir, options = sys.argv[1], sys.argv[2], sys.argv[3], json.loads(sys.argv[4])
reqs = json.load(open(path))
if engine.startswith("vllm"):
    from vllm import LLM, SamplingParams
    llm = LLM(model=hf_dir, dtype="bfloat16", max_model_len=1024, enable_prefix_caching=False, **options)
    prompts = [{"prompt_token_ids": p} for p, _ in reqs]
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for _, n in reqs]
    llm.generate(prompts[:4], params[:4], use_tqdm=False)
    t = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    secs = time.perf_counter() - t
    made = sum(len(o.outputs[0].token_ids) for o in outs)
else:
    from tokenmill import LLM, SamplingParams
    llm = LLM(max_model_len=1024, enable_prefix_caching=False, **options)
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for _, n in reqs]
    llm.generate([p for p, _ in reqs[:4]], params[:4])
    t = time.perf_counter()
    outs = llm.generate([p for p, _ in reqs], params)
    secs = time.perf_counter() - t
    made = sum(len(o.outputs[0].token_ids) for o in outs)
print("RESULT " + json.dumps({"seconds": secs, "output_tokens": made}))
"""


def workload(n: int, vocab: int, seed: int) -> list[tuple[list[int], int]]:
    rng = random.Random(seed)
    return [
        ([rng.randrange(100, vocab) for _ in range(rng.randint(32, 512))], rng.randint(16, 256))
        for _ in range(n)
    ]


def floors(
    reqs: list[tuple[list[int], int]], a: Arch, kv_bytes_per_value: float, gflops: float, gbs: float
) -> tuple[float, float]:
    """The fastest the workload could run here, two ways (seconds): its arithmetic at the bf16 matmul rate
    (every prompt token through the layers, every output token through the layers and the head, causal
    attention over each prompt and each output token's context), and decode attention's KV reads at the
    read bandwidth (each output token reads its whole context once). Either is a floor on its own; the
    weights' reads of the small steps at the run's end are left out, so the real limit lies above both."""
    body, head, width = a.params_active_nonembedding, a.vocab * a.hidden, a.heads * a.head_dim
    kv_token = a.kv_bytes_per_token(kv_bytes_per_value)
    total = kv = 0.0
    for prompt, out in reqs:
        p = len(prompt)
        contexts = out * p + out * (out - 1) / 2  # output token i attends to p + i tokens
        total += flop(body, head, width, a.layers, p, out, p * p / 2 + contexts)
        kv += contexts * kv_token
    return total / (gflops * 1e9), kv / (gbs * 1e9)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--num-requests", type=int, default=256)
    ap.add_argument("--engines", default="tokenmill,vllm")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--model", help="tokenmill's model (default: the embedded one)")
    ap.add_argument("--hf-dir", type=Path, help="vLLM's model directory (default PEERS_DIR/smollm2-135m-hf)")
    ap.add_argument(
        "--kv-cache-memory-gb",
        type=float,
        default=4.0,
        help="KV budget of both engines (tokenmill's kv_cache_memory_gb, vLLM's VLLM_CPU_KVCACHE_SPACE)",
    )
    add_flag(ap)
    args = ap.parse_args()
    hf_dir = args.hf_dir.expanduser() if args.hf_dir else PEERS / "smollm2-135m-hf"
    vllm_python = str(PEERS / "vllm-venv" / "bin" / "python")
    pythons = {e: vllm_python if e.startswith("vllm") else sys.executable for e in args.engines.split(",")}
    # "tokenmill-int8" / "tokenmill-fp8" / "vllm-fp8": that engine with that KV cache dtype.
    engines = args.engines.split(",")
    options = {e: {"kv_cache_dtype": e.split("-", 1)[1]} if "-" in e else {} for e in engines}
    for e in engines:  # the same KV budget for both: a bigger pool runs more requests at once
        if e.startswith("tokenmill"):
            options[e]["kv_cache_memory_gb"] = args.kv_cache_memory_gb
            if args.model:
                options[e]["model"] = args.model
    if any(e.startswith("vllm") for e in engines) and not (Path(vllm_python).exists() and hf_dir.exists()):
        sys.exit("vLLM is not set up: run benchmarks/peers/setup_vllm.sh and export_hf.py first")
    reqs = workload(args.num_requests, 49152, args.seed)
    prompt_tokens = sum(len(p) for p, _ in reqs)
    print(f"CPU: {cpu_description()}; {len(reqs)} requests, {prompt_tokens} prompt tokens")
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "reqs.json"
        path.write_text(json.dumps(reqs))
        for e in engines:
            env = {**os.environ}
            if e.startswith("vllm"):
                env.setdefault("VLLM_CPU_OMP_THREADS_BIND", "0-1")
                env.setdefault("VLLM_CPU_KVCACHE_SPACE", f"{args.kv_cache_memory_gb:g}")
            r = subprocess.run(
                [pythons[e], "-c", RUNNER, e, str(path), str(hf_dir), json.dumps(options[e])],
                capture_output=True,
                text=True,
                env=env,
            )
            line = next((x for x in r.stdout.splitlines() if x.startswith("RESULT ")), None)
            if line is None:
                sys.exit(f"{e} failed (exit {r.returncode}): {r.stderr.strip().splitlines()[-1:]}")
            res = json.loads(line[7:])
            results[e] = res
            out_tps = res["output_tokens"] / res["seconds"]
            all_tps = (res["output_tokens"] + prompt_tokens) / res["seconds"]
            secs = res["seconds"]
            print(f"{e}: {secs:.1f} s, {out_tps:.1f} output tok/s, {all_tps:.1f} tok/s with prompts")
    figures: dict[str, float] = {}
    for e in results:
        for v in results:
            if e.startswith("tokenmill") and v.startswith("vllm"):
                print(f"{e} / {v}: {results[v]['seconds'] / results[e]['seconds']:.2f}x")
                # "offline_over_vllm" for the bf16 pair; "offline_int8_kv_over_vllm" for tokenmill-int8
                kv = "".join(f"_{x}_kv" for x in (e.split("-", 1)[1:] + v.split("-", 1)[1:]))
                figures[f"offline{kv}_over_vllm"] = results[v]["seconds"] / results[e]["seconds"]

    # How near each run came to this machine's limit, measured after the runs (the same threads).
    a = resolve(args.model or (str(hf_dir) if hf_dir.exists() else "smollm2-135m"))
    gflops, gbs = matmul_rate_gflops("bf16"), read_bandwidth_gbs()
    print(f"bf16 matmul rate {gflops:.0f} GFLOP/s, read bandwidth {gbs:.1f} GB/s")
    for e, res in results.items():
        kv_value = 2.0 if "-" not in e else 1.0 + (4 / a.head_dim if e.startswith("tokenmill") else 0)
        flop_s, kv_s = floors(reqs, a, kv_value, gflops, gbs)
        print(
            f"{e}: arithmetic floor {flop_s:.1f} s ({flop_s / res['seconds']:.0%} of its time), decode"
            f" attention's KV reads {kv_s:.1f} s ({kv_s / res['seconds']:.0%})"
        )
    record("peers_offline", figures, args=args)


if __name__ == "__main__":
    main()
