"""KV-aware routing against round-robin and random, on two workers of this machine, in one run.

For each policy a real `tokenmill serve --workers 2 --router POLICY` starts (each worker gets one
core), and `tokenmill bench` sends the same multi-turn workload: conversations that share one of a
few long system prompts, each turn resending the history. A router that sends a conversation where
its prefix is cached saves the prefill of everything but the new turn. One worker alone on the same
workload is measured too. Reported: TTFT p50/p90, output throughput, the prefix-cache hit rate the
workers saw, and what the router credited.

    python benchmarks/kv_routing.py [--conversations 16] [--turns 4] [--prefix-tokens 512]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
from results_log import add_flag, record  # noqa: E402
from server_fixture import running_server  # noqa: E402


def scrape(base: str) -> tuple[dict[str, float], list[float]]:
    """Each metric summed over its series (a fleet labels them by worker), and the prompt tokens each
    worker was given (its prefix-cache queries): how evenly the router spread the work."""
    out: dict[str, float] = {}
    per_worker: list[float] = []
    for line in httpx.get(f"{base}/metrics", timeout=10).text.splitlines():
        if line.startswith("#") or not line.strip():
            continue
        name, value = line.rsplit(" ", 1)
        out[name.split("{", 1)[0]] = out.get(name.split("{", 1)[0], 0.0) + float(value)
        if name.startswith("tokenmill:prefix_cache_queries_total"):
            per_worker.append(float(value))
    return out, per_worker


def run_one(policy: str, workers: int, args: argparse.Namespace, folder: Path) -> dict:
    extra = ["--workers", str(workers), "--router", policy] if workers > 1 else []
    kv = ["--kv-cache-memory-gb", str(args.kv_cache_gb)]
    with running_server(*extra, "--max-model-len", "4096", *kv) as proc:
        base = proc.base_url  # type: ignore[attr-defined]
        out = folder / f"{policy}-{workers}"
        cmd = [
            sys.executable, "-m", "tokenmill.cli.main", "bench", "--url", base,
            "--concurrency", str(args.concurrency), "--num-requests", str(args.conversations * args.turns),
            "--prefix-groups", str(args.groups), "--prefix-tokens", str(args.prefix_tokens),
            "--turns", str(args.turns), "--isl", str(args.isl), "--osl", str(args.osl),
            "--tokenizer", "smollm2-135m", "--seed", str(args.seed), "--output", str(out),
        ]  # fmt: skip
        t0 = time.perf_counter()
        subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
        wall = time.perf_counter() - t0
        m, per_worker = scrape(base)
    s = json.loads((out / "summary.json").read_text())
    s = s.get("levels", [s])[0] if "levels" in s else s
    q = m.get("tokenmill:prefix_cache_queries_total", 0.0)
    return {
        "policy": policy if workers > 1 else "single worker",
        "workers": workers,
        "ttft_p50_ms": round(s["ttft_ms"]["p50"], 1),
        "ttft_p90_ms": round(s["ttft_ms"]["p90"], 1),
        "output_tok_s": round(s["output_token_throughput"], 1),
        "ok": s.get("completed", s.get("num_ok")),
        "prefix_hit_rate": round(m.get("tokenmill:prefix_cache_hits_total", 0.0) / q, 3) if q else None,
        "router_overlap_share": round(
            m.get("tokenmill:router_overlap_blocks_total", 0.0)
            / max(m.get("tokenmill:router_request_blocks_total", 0.0), 1.0),
            3,
        )
        if workers > 1
        else None,
        "prompt_tokens_per_worker": [round(x) for x in per_worker],
        "wall_s": round(wall, 1),
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--conversations", type=int, default=16)
    ap.add_argument("--turns", type=int, default=4)
    ap.add_argument("--groups", type=int, default=4)
    ap.add_argument("--prefix-tokens", type=int, default=512)
    ap.add_argument("--isl", type=int, default=64, help="tokens of each new user turn")
    ap.add_argument("--osl", type=int, default=32)
    ap.add_argument("--concurrency", type=int, default=4)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--kv-cache-gb", type=float, default=0.5, help="KV cache of each worker")
    ap.add_argument("--policies", default="kv,round-robin,random")
    ap.add_argument("--no-single", action="store_true", help="skip the one-worker run")
    add_flag(ap)
    args = ap.parse_args()
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for policy in args.policies.split(","):
            rows.append(run_one(policy, 2, args, Path(tmp)))
            print(json.dumps(rows[-1]), flush=True)
        if not args.no_single:
            rows.append(run_one("kv", 1, args, Path(tmp)))
            print(json.dumps(rows[-1]), flush=True)
    base = {r["policy"]: r for r in rows}
    if "kv" in base and "round-robin" in base:
        rr, kv = base["round-robin"], base["kv"]
        figures = {
            "ttft_p50_round_robin_over_kv": round(rr["ttft_p50_ms"] / kv["ttft_p50_ms"], 2),
            "throughput_kv_over_round_robin": round(kv["output_tok_s"] / rr["output_tok_s"], 3),
        }
        print(json.dumps(figures))
        record("kv_routing", figures, args=args)


if __name__ == "__main__":
    main()
