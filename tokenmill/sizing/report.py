"""What a sizing answer says: servers and GPUs, the chosen shape, latencies, daily volumes, cost,
energy, and the throughput-versus-interactivity frontier of all shapes that met the limits."""

from __future__ import annotations

import io
import math
from pathlib import Path
from typing import Any

from tokenmill.extras import require
from tokenmill.sizing.arch import Arch
from tokenmill.sizing.hardware import Factors, Gpu
from tokenmill.sizing.search import SizingResult, frontier


def sizing_summary(
    r: SizingResult,
    arch: Arch,
    gpu: Gpu,
    precision: str,
    factors: Factors,
    isl: int,
    osl: int,
    average_rps: float | None,
    gpu_hour_price: float,
    inputs: dict[str, Any],
) -> dict[str, Any]:
    out: dict[str, Any] = {
        "inputs": inputs,
        "model": {
            "name": arch.name,
            "params_total_b": arch.params_total / 1e9,
            "params_active_b": arch.params_active / 1e9,
            "layers": arch.layers,
        },
        "gpu": gpu.name,
        "precision": precision,
        "factors": factors.to_dict(),
        "peak_rps": r.peak_rps,
        "notes": r.notes,
    }
    if r.best is None:
        out["servers"] = None
        return out
    b = r.best
    servers = r.servers or 0
    gpus = servers * gpu.gpus_per_server
    capacity = servers * b.rps_per_server
    load = average_rps if average_rps is not None else r.peak_rps
    cost_per_hour = gpus * gpu_hour_price
    out_tps_capacity = capacity * osl
    out.update(
        {
            "servers": servers,
            "gpus": gpus,
            "chosen": b.to_dict(osl, gpu.gpus_per_server),
            "capacity_rps": capacity,
            "daily_volume_basis": "average rate" if average_rps is not None else "peak rate all day",
            "requests_per_day": load * 86400,
            "input_tokens_per_day": load * 86400 * isl,
            "output_tokens_per_day": load * 86400 * osl,
            "cost_per_hour_usd": cost_per_hour,
            # At full use of the sized capacity; lower load costs more per token.
            "cost_per_million_output_tokens_usd": cost_per_hour / (out_tps_capacity * 3600) * 1e6,
            "cost_per_million_tokens_usd": cost_per_hour / (capacity * (isl + osl) * 3600) * 1e6,
            # GPUs at TDP (an upper bound; GPU power only, not CPUs, network or cooling).
            "energy_per_output_token_j": gpus * gpu.tdp_w / out_tps_capacity,
            "assumptions": [
                f"{gpu.gpus_per_server} GPUs per server; {gpu_hour_price:g} USD per GPU-hour (indicative)",
                "cost and energy per token at full use of the sized capacity; energy at TDP, GPUs only",
                f"efficiency factors: {factors.source}",
                "lockstep closed-loop model: C prompts prefilled together, decoded at context ISL + OSL/2",
            ],
            "alternatives": _alternatives(r, osl, gpu),
        }
    )
    return out


def shape(c: dict[str, Any]) -> str:
    """A configuration's parallel shape as the CLI and report.html name it: TP4 x PP2 EP."""
    return f"TP{c['tp']}" + (f" x PP{c['pp']}" if c["pp"] > 1 else "") + (" EP" if c["ep"] else "")


def _alternatives(r: SizingResult, osl: int, gpu: Gpu, n: int = 6) -> list[dict[str, Any]]:
    """The best concurrency of each other parallel shape, fewest servers first."""
    best_of: dict[tuple, Any] = {}
    for c in r.feasible:
        k = (c.tp, c.pp, c.ep)
        if k not in best_of or c.rps_per_server > best_of[k].rps_per_server:
            best_of[k] = c
    rows = []
    for c in sorted(best_of.values(), key=lambda c: -c.rps_per_server)[:n]:
        d = c.to_dict(osl, gpu.gpus_per_server)
        d["servers"] = math.ceil(r.peak_rps / c.rps_per_server)
        rows.append(d)
    return rows


def plot_frontier(r: SizingResult, osl: int, path: Path | None, title: str) -> bytes | None:
    """Draw the frontier of the shapes that met the limits; save it at `path` (the format its suffix
    says) when given, and return it as PNG bytes for report.html; None when no shape met them."""
    require("bench", "the frontier plot (tokenmill size --plot)")
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    pts = [(1 / c.prediction.itl_s, c.prediction.rps * osl / c.gpus_per_instance, c) for c in r.feasible]
    if not pts:
        return None
    fig, ax = plt.subplots(figsize=(7, 4.8))
    shapes = sorted({(c.tp, c.pp, c.ep) for _, _, c in pts})
    cmap = plt.get_cmap("tab10")
    for i, s in enumerate(shapes):
        xs = [x for x, _, c in pts if (c.tp, c.pp, c.ep) == s]
        ys = [y for _, y, c in pts if (c.tp, c.pp, c.ep) == s]
        label = f"TP{s[0]}" + (f" PP{s[1]}" if s[1] > 1 else "") + (" EP" if s[2] else "")
        ax.scatter(xs, ys, s=10, color=cmap(i % 10), label=label, alpha=0.7)
    fx, fy = zip(*frontier([(x, y) for x, y, _ in pts]), strict=True)
    ax.plot(fx, fy, "k-", lw=1, label="frontier")
    if r.best is not None:
        b = r.best.prediction
        ax.scatter(
            [1 / b.itl_s],
            [b.rps * osl / r.best.gpus_per_instance],
            s=120,
            facecolors="none",
            edgecolors="red",
            linewidths=2,
            label="chosen",
        )
    ax.set_xlabel("output tokens/s per user (1 / ITL)")
    ax.set_ylabel("output tokens/s per GPU")
    ax.set_title(title, fontsize=10)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    if path is not None:
        fig.savefig(path, dpi=110)
    buf = io.BytesIO()  # drawn once: the same figure goes to the file and into report.html
    fig.savefig(buf, format="png", dpi=110)
    plt.close(fig)
    return buf.getvalue()
