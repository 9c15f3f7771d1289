"""Size this machine: calibrate the sizing model on one `tokenmill bench` run, predict other loads.

Starts `tokenmill serve` on the embedded model, measures a calibration sweep (chat, 128 prompt
tokens + template, 64 output tokens, concurrency 1, 2, 4, 8), fits the efficiency factors of the
"cpu-2c" entry to it, then measures loads the fit never saw (concurrency 16 and 24 with the same
lengths; concurrency 4 with 512 prompt tokens and 32 output tokens) and prints predicted against
measured TTFT, ITL and requests/s.

    python benchmarks/sizing_this_machine.py
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
from server_fixture import running_server  # noqa: E402

from tokenmill.bench.client import ClientConfig  # noqa: E402
from tokenmill.bench.load import LoadConfig  # noqa: E402
from tokenmill.bench.runner import run_bench  # noqa: E402
from tokenmill.bench.workload import WorkloadConfig, load_counter  # noqa: E402
from tokenmill.sizing.arch import CATALOG as MODELS  # noqa: E402
from tokenmill.sizing.calibrate import Measurement, fit  # noqa: E402
from tokenmill.sizing.hardware import CATALOG as GPUS  # noqa: E402
from tokenmill.sizing.hardware import default_factors  # noqa: E402
from tokenmill.sizing.roofline import Deployment, predict  # noqa: E402


def measure(url: str, counter, isl: int, osl: int, concurrencies: list[int]) -> list[Measurement]:
    cfg = ClientConfig(base_url=url, model="smollm2-135m", endpoint="chat")
    loads = [
        LoadConfig(concurrency=c, num_requests=max(12, 4 * c), warmup_requests=min(c, 4))
        for c in concurrencies
    ]
    res = run_bench(cfg, WorkloadConfig(isl=isl, osl=osl), loads, [], counter, lambda *a: lambda r: None)
    out = []
    for lv in res.levels:
        s = lv.summary
        assert s["failed"] == 0, s["errors"]
        out.append(
            Measurement(
                lv.load.concurrency,
                s["isl"]["mean"],
                s["osl"]["mean"],
                s["ttft_ms"]["mean"] / 1e3,
                s["itl_ms"]["mean"] / 1e3,
                s["request_throughput"],
                s["label"],
            )
        )
    return out


def main() -> None:
    counter, _ = load_counter("smollm2-135m", None)
    with running_server("--max-num-seqs", "32") as proc:
        url = f"{proc.base_url}/v1"
        calib = measure(url, counter, 128, 64, [1, 2, 4, 8])
        later = measure(url, counter, 128, 64, [16, 24]) + measure(url, counter, 512, 32, [4])
    d = Deployment(MODELS["smollm2-135m"], GPUS["cpu-2c"], "bf16", default_factors("cpu-2c", "bf16"))
    result = fit([(d, calib)], d.factors)
    f = result.factors
    print(
        f"fitted: MFU {f.mfu:.3f}, MBU weights {f.mbu_weights:.3f}, MBU KV {f.mbu_kv:.3f}, "
        f"overhead {f.overhead_per_layer_s * 1e6:.0f} us/layer, client {f.client_s * 1e3:.1f} ms; "
        "fit error (median): " + ", ".join(f"{k} {v['median'] * 100:.1f}%" for k, v in result.errors.items())
    )
    print("| load | set | TTFT ms meas / pred | ITL ms meas / pred | req/s meas / pred |")
    print("|---|---|---|---|---|")
    fitted = Deployment(d.arch, d.gpu, d.precision, f)
    for name, ms in (("calibration", calib), ("predicted", later)):
        for m in ms:
            p = predict(fitted, round(m.concurrency), round(m.isl), round(m.osl))
            print(
                f"| C={m.concurrency:g}, ISL {m.isl:.0f}, OSL {m.osl:.0f} | {name} "
                f"| {m.ttft_s * 1e3:.0f} / {p.ttft_s * 1e3:.0f} ({p.ttft_s / m.ttft_s - 1:+.0%}) "
                f"| {m.itl_s * 1e3:.1f} / {p.itl_s * 1e3:.1f} ({p.itl_s / m.itl_s - 1:+.0%}) "
                f"| {m.rps:.2f} / {p.rps:.2f} ({p.rps / m.rps - 1:+.0%}) |"
            )


if __name__ == "__main__":
    main()
