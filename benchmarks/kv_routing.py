"""KV-aware routing against round-robin on two workers of this machine, per workload family, in one run.

For each family and policy a real `tokenmill serve --workers 2 --router POLICY` starts (each worker gets
one core), and `tokenmill bench` sends the family's workload, closed loop:

- `shared`: few long shared prompts. Four 1024-token system prompts, one question each. Every
  worker's cache holds all four, so round-robin hits as often as kv: kv can only lose here (by piling
  work on the worker it favours), and must not.
- `documents`: many private documents. Each conversation has its own 1024-token document and asks
  four questions about it, each turn resending the history. Round-robin sends a conversation's turns
  to either worker, so a turn often lands where its document is not (or no longer) cached; kv sends
  it where the document is.
- `agentic`: agentic multi-turn. One shared 768-token tool preamble, then six turns, each adding a
  192-token tool output and resending the whole history: the conversation's own growing prefix is
  what a worker holds.
- `hot`: one hot prompt. A single 768-token system prompt, one question each: the worker that holds
  it first is where kv's cost keeps sending new requests, until its load outweighs prefilling the
  prompt once on the other worker.

Reported per family and policy: TTFT p50/p90, output throughput, the prefix-cache hit rate the workers
saw, the share of prompt blocks the router credited as cached, and how the prompt tokens were spread.

    python benchmarks/kv_routing.py [--families shared,documents,agentic,hot] [--policies kv,round-robin]
"""

from __future__ import annotations

import argparse
import json
import shlex
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
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


@dataclass(frozen=True)
class Family:
    groups: int  # system prompts shared by the sessions; 0: each session has its own
    prefix_tokens: int
    turns: int
    isl: int  # tokens each turn adds
    osl: int
    sessions: int
    kv_cache_gb: float  # each worker's KV cache


FAMILIES = {
    "shared": Family(groups=4, prefix_tokens=1024, turns=1, isl=64, osl=32, sessions=48, kv_cache_gb=0.5),
    "documents": Family(groups=0, prefix_tokens=1024, turns=4, isl=48, osl=24, sessions=16, kv_cache_gb=0.5),
    "agentic": Family(groups=1, prefix_tokens=768, turns=6, isl=192, osl=32, sessions=8, kv_cache_gb=0.5),
    "hot": Family(groups=1, prefix_tokens=768, turns=1, isl=64, osl=32, sessions=48, kv_cache_gb=0.5),
}


def run_one(
    name: str, fam: Family, policy: str, workers: int, args: argparse.Namespace, folder: Path
) -> dict:
    extra = ["--workers", str(workers), "--router", policy] if workers > 1 else []
    kv = ["--kv-cache-memory-gb", str(args.kv_cache_gb or fam.kv_cache_gb)]
    sessions = max(1, round(fam.sessions * args.scale))
    groups = fam.groups or sessions  # one document per session
    with running_server(*extra, "--max-model-len", "4096", *kv, *shlex.split(args.serve_args)) as proc:
        base = proc.base_url  # type: ignore[attr-defined]
        out = folder / f"{name}-{policy}-{workers}"
        cmd = [
            sys.executable, "-m", "tokenmill.cli.main", "bench", "--url", base,
            "--concurrency", str(args.concurrency), "--num-requests", str(sessions * fam.turns),
            "--prefix-groups", str(groups), "--prefix-tokens", str(fam.prefix_tokens),
            "--turns", str(fam.turns), "--isl", str(fam.isl), "--osl", str(fam.osl),
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
        "family": name,
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
    ap.add_argument("--families", default=",".join(FAMILIES))
    ap.add_argument("--policies", default="kv,round-robin")
    ap.add_argument("--concurrency", type=int, default=4)
    ap.add_argument("--scale", type=float, default=1.0, help="multiply each family's session count")
    ap.add_argument(
        "--kv-cache-gb", type=float, default=None, help="each worker's KV cache (default: the family's)"
    )
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument(
        "--serve-args", default="", help="more `tokenmill serve` flags, e.g. '--router-prefill-weight 4'"
    )
    ap.add_argument("--single", action="store_true", help="also run one worker alone (kv) per family")
    add_flag(ap)
    args = ap.parse_args()
    names = args.families.split(",")
    unknown = [n for n in names if n not in FAMILIES]
    if unknown:
        raise SystemExit(f"unknown families {unknown}: use {', '.join(FAMILIES)}")
    rows = []
    figures: dict[str, float] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for name in names:
            fam = FAMILIES[name]
            got = {}
            for policy in args.policies.split(","):
                got[policy] = run_one(name, fam, policy, 2, args, Path(tmp))
                rows.append(got[policy])
                print(json.dumps(rows[-1]), flush=True)
            if args.single:
                rows.append(run_one(name, fam, "kv", 1, args, Path(tmp)))
                print(json.dumps(rows[-1]), flush=True)
            if "kv" in got and "round-robin" in got:
                rr, kv = got["round-robin"], got["kv"]
                figures[f"ttft_p50_round_robin_over_kv_{name}"] = round(
                    rr["ttft_p50_ms"] / kv["ttft_p50_ms"], 2
                )
                figures[f"ttft_p90_round_robin_over_kv_{name}"] = round(
                    rr["ttft_p90_ms"] / kv["ttft_p90_ms"], 2
                )
                figures[f"throughput_kv_over_round_robin_{name}"] = round(
                    kv["output_tok_s"] / rr["output_tok_s"], 3
                )
                figures[f"hit_rate_kv_{name}"] = kv["prefix_hit_rate"] or 0.0
                figures[f"hit_rate_round_robin_{name}"] = rr["prefix_hit_rate"] or 0.0
    if figures:
        fams = [n for n in names if f"ttft_p50_round_robin_over_kv_{n}" in figures]
        if len(fams) == len(
            FAMILIES
        ):  # "never worse" is a claim over every family, so only a full run makes it
            figures["worst_kv_over_round_robin"] = min(
                min(
                    figures[f"ttft_p50_round_robin_over_kv_{n}"],
                    figures[f"throughput_kv_over_round_robin_{n}"],
                )
                for n in fams
            )
        print(json.dumps(figures))
        record("kv_routing", figures, args=args)


if __name__ == "__main__":
    main()
