"""Is `tokenmill bench` itself ever the bottleneck? Its ceiling against what it reports for tokenmill.

Runs the same workload (32 concurrent streaming chat requests, 128 tokens in, 64 out) twice in one
run: against `tokenmill serve` on the embedded model, and against the fake server with no delays at
all (tokenmill/bench/fake_server.py, in its own process), where the load generator is the limit.
Reports requests/s, streamed tokens/s and the client's CPU share for both, and the ratio.

    python benchmarks/bench_client_capacity.py [--concurrency 32] [--num-requests 128]
"""

from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
from server_fixture import running_server  # noqa: E402

from tokenmill.bench.client import ClientConfig  # noqa: E402
from tokenmill.bench.load import LoadConfig  # noqa: E402
from tokenmill.bench.runner import run_bench  # noqa: E402
from tokenmill.bench.workload import WorkloadConfig, load_counter  # noqa: E402


def measure(url: str, model: str, concurrency: int, n: int, counter) -> dict:
    cfg = ClientConfig(base_url=url, model=model, endpoint="chat")
    wl = WorkloadConfig(isl=128, osl=64)
    load = LoadConfig(concurrency=concurrency, num_requests=n, warmup_requests=concurrency)
    s = run_bench(cfg, wl, [load], [], counter, lambda *a: lambda r: None).levels[0].summary
    assert s["failed"] == 0, s["errors"]
    return s


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--concurrency", type=int, default=32)
    ap.add_argument("--num-requests", type=int, default=128)
    a = ap.parse_args()
    counter, _ = load_counter("smollm2-135m", None)
    with running_server("--max-num-seqs", str(a.concurrency)) as proc:
        real = measure(f"{proc.base_url}/v1", "smollm2-135m", a.concurrency, a.num_requests, counter)
    cmd = [sys.executable, "-m", "tokenmill.bench.fake_server", "--first-token-ms", "0", "--itl-ms", "0"]
    fake_proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True)
    try:
        url = fake_proc.stdout.readline().split()[-1]
        fake = measure(url, "fake-model", a.concurrency, a.num_requests * 20, counter)
    finally:
        fake_proc.terminate()
    print("| target | req/s | streamed tok/s | client CPU (% of one core) |")
    print("|---|---|---|---|")
    for name, s in (("tokenmill serve (embedded model)", real), ("fake server, no delays", fake)):
        print(
            f"| {name} | {s['request_throughput']:.2f} | {s['output_token_throughput']:.0f} "
            f"| {s['client_cpu_pct']:.1f} |"
        )
    ratio = fake["output_token_throughput"] / real["output_token_throughput"]
    print(f"load generator ceiling / rate measured on tokenmill: {ratio:.1f}x (tokens/s)")


if __name__ == "__main__":
    main()
