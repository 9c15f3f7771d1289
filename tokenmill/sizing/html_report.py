"""report.html of `tokenmill size --output DIR`: the use case, the chosen configuration, the
alternatives, the frontier plot, and how far the answer can be trusted (the efficiency factors it
rests on, the error of their fit when they were calibrated, the model's assumptions), in one file that
needs no network. Built from the sizing summary (report.sizing_summary, the JSON `--json` prints);
each number's cell carries data-key, its path in that JSON, and data-format, the format it is shown in.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

from tokenmill.bench.html_report import REPORT, config_table, esc, img, page, para, table, td, value_at
from tokenmill.sizing.report import shape

# (label, key in the summary, format): the rows of the chosen configuration, as `tokenmill size` prints
CHOSEN = (
    ("servers", "servers", "d"),
    ("GPUs", "gpus", "d"),
    ("instances per server", "chosen.instances_per_server", "d"),
    ("GPUs per instance", "chosen.gpus_per_instance", "d"),
    ("requests in flight per instance", "chosen.concurrency_per_instance", "d"),
    ("TTFT ms", "chosen.ttft_ms", ".0f"),
    ("inter-token latency ms", "chosen.itl_ms", ".1f"),
    ("output tokens/s per user", "chosen.output_tps_per_user", ".0f"),
    ("end-to-end ms", "chosen.e2e_ms", ".0f"),
    ("requests/s per server", "chosen.rps_per_server", ".2f"),
    ("capacity requests/s", "capacity_rps", ".1f"),
    ("output tokens/s per GPU", "chosen.output_tps_per_gpu", ".0f"),
    ("requests per day", "requests_per_day", ",.0f"),
    ("input tokens per day", "input_tokens_per_day", ",.0f"),
    ("output tokens per day", "output_tokens_per_day", ",.0f"),
    ("cost per hour USD", "cost_per_hour_usd", ",.2f"),
    ("cost per 1M output tokens USD", "cost_per_million_output_tokens_usd", ".3f"),
    ("cost per 1M tokens USD", "cost_per_million_tokens_usd", ".3f"),
    ("energy per output token J", "energy_per_output_token_j", ".3f"),
)
ALTERNATIVES = (
    ("instances/server", "instances_per_server", "d"),
    ("in flight", "concurrency_per_instance", "d"),
    ("TTFT ms", "ttft_ms", ".0f"),
    ("ITL ms", "itl_ms", ".1f"),
    ("E2E ms", "e2e_ms", ".0f"),
    ("tok/s/user", "output_tps_per_user", ".0f"),
    ("req/s/server", "rps_per_server", ".2f"),
    ("servers", "servers", "d"),
)
FACTORS = (
    ("MFU (share of peak FLOPs, prefill)", "mfu", ".3g"),
    ("MBU weights (share of peak bandwidth)", "mbu_weights", ".3g"),
    ("MBU KV cache", "mbu_kv", ".3g"),
    ("overhead per layer per step s", "overhead_per_layer_s", ".3g"),
    ("all-reduce latency s", "allreduce_latency_s", ".3g"),
    ("link efficiency", "link_efficiency", ".3g"),
    ("client share of TTFT s", "client_s", ".3g"),
)


def _rows(s: Mapping[str, Any], spec: tuple[tuple[str, str, str], ...], prefix: str = "") -> list[list[str]]:
    return [
        [td(text=label), td(value_at(s, f"{prefix}{key}"), f"{prefix}{key}", spec=fmt)]
        for label, key, fmt in spec
        if value_at(s, f"{prefix}{key}") is not None
    ]


def _trust(s: Mapping[str, Any]) -> list[str]:
    """What the sizing says about its own error: the factors and their source, the calibration fit's
    error when there is one, and the assumptions of the model."""
    factors = s.get("factors") or {}
    out = [
        "<h2>How far to trust it</h2>",
        para(f"Efficiency factors: {factors.get('source', 'unknown')}."),
        table(("factor", "value"), _rows(s, FACTORS, "factors.")),
    ]
    fit = s.get("factor_fit_error")
    if fit:
        out.append(para("Error of the calibration fit these factors come from, |predicted / measured - 1|:"))
        rows = [
            [
                td(text=metric),
                *(td(e.get(k), f"factor_fit_error.{metric}.{k}", spec=".1%") for k in ("median", "max")),
            ]
            for metric, e in fit.items()
        ]
        out.append(table(("metric", "median", "max"), rows, "summary"))
    else:
        out.append(
            para(
                "These factors carry no measured error for your hardware and engine: fit them to your own "
                "tokenmill bench results with tokenmill size calibrate --output factors.json, which records "
                "the fit's error, and size with --factors factors.json to see that error here."
            )
        )
    assumptions = s.get("assumptions") or []
    if assumptions:
        out.append("<ul>" + "".join(f"<li>{esc(a)}</li>" for a in assumptions) + "</ul>")
    return out


def write_html(out: Path, s: Mapping[str, Any], frontier_png: bytes | None) -> Path:
    """Write out/report.html for the sizing summary `s`; return its path."""
    model = s["model"]["name"]
    if s.get("servers") is None:
        title = f"tokenmill size: no configuration of {model} on {s['gpu']} meets the limits"
    else:
        title = f"tokenmill size: {s['servers']} servers ({s['gpus']} x {s['gpu']}) for {model}"
    use_case = {
        "model": model,
        "parameters total (B)": round(s["model"]["params_total_b"], 2),
        "parameters active (B)": round(s["model"]["params_active_b"], 2),
        "gpu": s["gpu"],
        "precision": s["precision"],
        **s["inputs"],
    }
    body = [f"<h1>{esc(title)}</h1>", "<h2>Use case</h2>", config_table(use_case)]
    for note in s.get("notes") or []:
        body.append(para(note, "bad"))
    if s.get("servers") is not None:
        c = s["chosen"]
        body += [
            "<h2>Chosen configuration</h2>",
            para(f"{shape(c)}; requests per day from the {s['daily_volume_basis']}."),
            table(("", "value"), _rows(s, CHOSEN), "summary"),
            "<h2>Alternatives</h2>",
            para("The best concurrency of each other parallel shape that met the limits.", "note"),
        ]
        rows = [
            [td(text=shape(a)), *(td(a.get(k), f"alternatives.{i}.{k}", spec=f) for _, k, f in ALTERNATIVES)]
            for i, a in enumerate(s.get("alternatives") or [])
        ]
        body.append(table(("shape", *(name for name, _, _ in ALTERNATIVES)), rows, "summary"))
    body += [
        "<h2>Frontier</h2>",
        img(frontier_png, "throughput vs interactivity of every shape that met the limits"),
    ]
    body += _trust(s)
    path = out / REPORT
    path.write_text(page(title, body), encoding="utf-8")
    return path
