"""Dynamic batching and instance count for a small ONNX model, in one run.

An ONNX MLP (256 -> 1024 -> 256, batch dimension free) is served from a temporary model repository
four ways: without and with the dynamic batcher (max batch 32, 1 ms queue delay), with 1 and 2
instances (one ONNX Runtime thread each). 32 concurrent clients send single-row requests through
the repository's scheduler (in process: this measures scheduling and execution, not HTTP).
Reports requests/s, p50/p99 latency, the average executed batch, and the ratio to the first row.

    python benchmarks/dynamic_batching.py [--requests 4000] [--concurrency 32]
"""

from __future__ import annotations

import argparse
import asyncio
import tempfile
import time
from pathlib import Path

import numpy as np

from tokenmill.triton.backends import Request
from tokenmill.triton.repository import ModelRepository

CONFIG = """name: "{name}"
platform: "onnxruntime_onnx"
max_batch_size: 32
input [ {{ name: "X" data_type: TYPE_FP32 dims: [ 256 ] }} ]
output [ {{ name: "Y" data_type: TYPE_FP32 dims: [ 256 ] }} ]
instance_group [ {{ count: {count} kind: KIND_CPU }} ]
{batching}
"""
VARIANTS = [
    ("no batching, 1 instance", 1, ""),
    ("dynamic batching, 1 instance", 1, "dynamic_batching { max_queue_delay_microseconds: 1000 }"),
    ("no batching, 2 instances", 2, ""),
    ("dynamic batching, 2 instances", 2, "dynamic_batching { max_queue_delay_microseconds: 1000 }"),
]


def make_mlp(path: Path) -> None:
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    rng = np.random.default_rng(0)
    w1 = rng.standard_normal((256, 1024)).astype(np.float32) / 16
    w2 = rng.standard_normal((1024, 256)).astype(np.float32) / 32
    graph = helper.make_graph(
        [
            helper.make_node("MatMul", ["X", "W1"], ["H"]),
            helper.make_node("Relu", ["H"], ["R"]),
            helper.make_node("MatMul", ["R", "W2"], ["Y"]),
        ],
        "mlp",
        [helper.make_tensor_value_info("X", TensorProto.FLOAT, ["batch", 256])],
        [helper.make_tensor_value_info("Y", TensorProto.FLOAT, ["batch", 256])],
        [numpy_helper.from_array(w1, "W1"), numpy_helper.from_array(w2, "W2")],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    path.parent.mkdir(parents=True, exist_ok=True)
    onnx.save(model, str(path))


async def measure(root: Path, name: str, n: int, concurrency: int) -> dict:
    repo = ModelRepository(root, mode="explicit", load_models=[name])
    await repo.start()
    x = np.ones((1, 256), np.float32)
    for _ in range(50):  # warm-up
        await repo.infer(name, None, Request({"X": x}))
    stats0 = repo.get(name).stats
    execs0, count0 = stats0.execution_count, stats0.inference_count
    latencies: list[float] = []
    todo = iter(range(n))

    async def client() -> None:
        for _ in todo:
            t = time.perf_counter()
            await repo.infer(name, None, Request({"X": x}))
            latencies.append(time.perf_counter() - t)

    t0 = time.perf_counter()
    await asyncio.gather(*(client() for _ in range(concurrency)))
    dt = time.perf_counter() - t0
    s = repo.get(name).stats
    avg_batch = (s.inference_count - count0) / max(1, s.execution_count - execs0)
    await repo.close()
    lat = np.array(latencies) * 1e3
    return {
        "rps": n / dt,
        "p50": float(np.percentile(lat, 50)),
        "p99": float(np.percentile(lat, 99)),
        "batch": avg_batch,
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--requests", type=int, default=4000)
    ap.add_argument("--concurrency", type=int, default=32)
    a = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        for i, (_, count, batching) in enumerate(VARIANTS):
            name = f"mlp{i}"
            (root / name).mkdir()
            (root / name / "config.pbtxt").write_text(
                CONFIG.format(name=name, count=count, batching=batching)
            )
            make_mlp(root / name / "1" / "model.onnx")
        rows = [
            asyncio.run(measure(root, f"mlp{i}", a.requests, a.concurrency)) for i in range(len(VARIANTS))
        ]
    base = rows[0]["rps"]
    print(f"{a.requests} single-row requests, {a.concurrency} concurrent clients")
    print("| configuration | req/s | p50 ms | p99 ms | avg batch | req/s ratio |")
    print("|---|---|---|---|---|---|")
    for (label, _, _), r in zip(VARIANTS, rows, strict=True):
        print(
            f"| {label} | {r['rps']:.0f} | {r['p50']:.2f} | {r['p99']:.2f} | {r['batch']:.1f} "
            f"| {r['rps'] / base:.2f} |"
        )


if __name__ == "__main__":
    main()
