"""NVIDIA's perf_analyzer against tokenmill's KServe v2 server, over HTTP and gRPC, streaming included.

One server (examples/model_repository plus a decoupled `ticker` model) and Triton's own load tool
(tests/get_perf_analyzer.sh fetches it; `make install` does). Each run is perf_analyzer's own
measurement (`-f` CSV: infer/s and latency percentiles in µs), so the figures are what a Triton user
would read on their machine:

- linear_onnx (ONNX Runtime, dynamic batching) at concurrency 1 and 8, over HTTP and gRPC;
- sleeper (a Python model that waits 100 ms, two instances) at concurrency 1 and 2: two instances
  should serve twice as many requests per second;
- ticker (decoupled: four responses per request) through gRPC ModelStreamInfer (`--streaming`).

    python benchmarks/triton_perf_analyzer.py            # ~2 minutes
"""

from __future__ import annotations

import argparse
import csv
import subprocess
import sys
import tempfile
import textwrap
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "tests"))
sys.path.insert(0, str(Path(__file__).resolve().parent))
import results_log  # noqa: E402
from server_fixture import example_repository, free_port, perf_analyzer_path, running_server  # noqa: E402

TICKER = """
import numpy as np
import triton_python_backend_utils as pb_utils

class TritonPythonModel:
    def execute(self, requests):
        for request in requests:
            values = pb_utils.get_input_tensor_by_name(request, "IN").as_numpy()
            sender = request.get_response_sender()
            for v in values:
                sender.send(pb_utils.InferenceResponse([pb_utils.Tensor("OUT", np.array([v], np.int32))]))
            sender.send(flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
        return None
"""
TICKER_CONFIG = """
name: "ticker"
backend: "python"
max_batch_size: 0
input [ { name: "IN" data_type: TYPE_INT32 dims: [ -1 ] } ]
output [ { name: "OUT" data_type: TYPE_INT32 dims: [ 1 ] } ]
model_transaction_policy { decoupled: true }
"""
# (label, model, protocol, concurrency, extra flags)
RUNS = [
    ("onnx_http_c1", "linear_onnx", "http", 1, []),
    ("onnx_http_c8", "linear_onnx", "http", 8, []),
    ("onnx_grpc_c1", "linear_onnx", "grpc", 1, []),
    ("onnx_grpc_c8", "linear_onnx", "grpc", 8, []),
    ("sleeper_http_c1", "sleeper", "http", 1, []),
    ("sleeper_http_c2", "sleeper", "http", 2, []),
    ("ticker_stream_c1", "ticker", "grpc", 1, ["--streaming", "--shape", "IN:4"]),
    ("ticker_stream_c4", "ticker", "grpc", 4, ["--streaming", "--shape", "IN:4"]),
]


def perf_analyzer() -> str:
    path = perf_analyzer_path()
    if path is None:
        raise SystemExit("perf_analyzer not found: run `bash tests/get_perf_analyzer.sh` (or `make install`)")
    return path


def run(
    pa: str, url: str, model: str, protocol: str, concurrency: int, extra: list[str], a: argparse.Namespace
):
    with tempfile.NamedTemporaryFile(suffix=".csv") as out:
        cmd = [pa, "-m", model, "-u", url, "-i", protocol, "--concurrency-range", str(concurrency),
               "-p", str(a.window_ms), "-s", str(a.stability), "-r", "20",
               "-f", out.name, *extra]  # fmt: skip
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
        if p.returncode != 0:
            raise SystemExit(
                f"perf_analyzer failed ({' '.join(cmd)}):\n{p.stdout[-2000:]}\n{p.stderr[-2000:]}"
            )
        with open(out.name) as f:
            row = next(csv.DictReader(f))
    return {"infer_s": float(row["Inferences/Second"]), "p99_us": float(row["p99 latency"])}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--window-ms", type=int, default=3000, help="perf_analyzer's measurement window (-p)")
    ap.add_argument("--stability", type=int, default=15, help="perf_analyzer's -s (percent)")
    results_log.add_flag(ap)
    a = ap.parse_args()
    pa = perf_analyzer()
    with tempfile.TemporaryDirectory() as tmp:
        root = example_repository(Path(tmp))
        (root / "ticker" / "1").mkdir(parents=True)
        (root / "ticker" / "config.pbtxt").write_text(textwrap.dedent(TICKER_CONFIG))
        (root / "ticker" / "1" / "model.py").write_text(TICKER)
        grpc_port = free_port()
        with running_server("--model-repository", str(root), "--grpc-port", str(grpc_port)) as proc:
            urls = {"http": proc.base_url.removeprefix("http://"), "grpc": f"127.0.0.1:{grpc_port}"}
            rows = {}
            for label, model, protocol, conc, extra in RUNS:
                rows[label] = run(pa, urls[protocol], model, protocol, conc, extra, a)
                r = rows[label]
                print(
                    f"  {label:18s} {r['infer_s']:9.1f} infer/s   p99 {r['p99_us'] / 1000:8.2f} ms",
                    flush=True,
                )
    metrics: dict[str, float] = {}
    for label, r in rows.items():
        metrics[f"{label}_infer_s"] = round(r["infer_s"], 1)
        metrics[f"{label}_p99_ms"] = round(r["p99_us"] / 1000, 3)
    metrics["sleeper_two_instances_scaling"] = round(
        rows["sleeper_http_c2"]["infer_s"] / rows["sleeper_http_c1"]["infer_s"], 3
    )
    metrics["onnx_grpc_over_http_c8"] = round(
        rows["onnx_grpc_c8"]["infer_s"] / rows["onnx_http_c8"]["infer_s"], 3
    )
    metrics["ticker_stream_c4_over_c1"] = round(
        rows["ticker_stream_c4"]["infer_s"] / rows["ticker_stream_c1"]["infer_s"], 3
    )
    print("| run | infer/s | p99 ms |")
    print("|---|---|---|")
    for label, r in rows.items():
        print(f"| {label} | {r['infer_s']:.1f} | {r['p99_us'] / 1000:.2f} |")
    print(f"two sleeper instances: {metrics['sleeper_two_instances_scaling']:.2f}x one stream's rate")
    print(f"linear_onnx at 8 streams, gRPC over HTTP: {metrics['onnx_grpc_over_http_c8']:.2f}x")
    results_log.record("triton_perf_analyzer", metrics, args=a)


if __name__ == "__main__":
    main()
