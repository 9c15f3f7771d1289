"""`tokenmill bench compare A.json B.json`: the same metrics of two runs side by side, with B/A ratios.

Works on single-level summaries and on sweeps (levels matched by label, e.g. concurrency8).
For latencies a ratio below 1 means B is faster; for throughputs a ratio above 1 means B does more.
`--html` writes the same as one page with both configurations and both curves (html_report.py).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

LATENCIES = ("ttft_ms", "ttst_ms", "itl_ms", "e2e_ms")
LATENCY_STATS = ("mean", "p50", "p90", "p99")
THROUGHPUTS = ("request_throughput", "output_token_throughput", "input_token_throughput", "goodput")
COUNTS = ("completed", "failed")


def load_summary(path: Path) -> dict[str, Any]:
    """A summary.json (or a run.json's summary); raises ValueError with what is wrong."""
    try:
        d = json.loads(path.read_text())
    except FileNotFoundError:
        raise ValueError(f"{path}: no such file") from None
    except json.JSONDecodeError as e:
        raise ValueError(f"{path}: not JSON ({e.msg})") from None
    if isinstance(d, dict) and "summary" in d and "records" in d:
        d = {"config": d.get("config"), **d["summary"]}
    if not isinstance(d, dict) or ("runs" not in d and "ttft_ms" not in d):
        raise ValueError(f"{path}: not a tokenmill bench summary.json")
    return d


def levels(d: dict[str, Any]) -> dict[str, dict[str, Any]]:
    runs = d.get("runs", [d])
    return {r.get("label", f"run{i}"): r for i, r in enumerate(runs)}


def _ratio(a: float | None, b: float | None) -> float | None:
    if a is None or b is None or a == 0:
        return None
    return b / a


def compare_rows(a: dict[str, Any], b: dict[str, Any]) -> list[tuple[str, Any, Any, float | None]]:
    rows: list[tuple[str, Any, Any, float | None]] = []
    for m in LATENCIES:
        sa, sb = a.get(m) or {}, b.get(m) or {}
        for k in LATENCY_STATS:
            rows.append((f"{m} {k}", sa.get(k), sb.get(k), _ratio(sa.get(k), sb.get(k))))
    for m in THROUGHPUTS + COUNTS:
        rows.append((m, a.get(m), b.get(m), _ratio(a.get(m), b.get(m))))
    return rows


def compare(path_a: Path, path_b: Path) -> dict[str, Any]:
    a, b = load_summary(path_a), load_summary(path_b)
    la, lb = levels(a), levels(b)
    if len(la) == 1 and len(lb) == 1:
        pairs = [(next(iter(la)) + " vs " + next(iter(lb)), next(iter(la.values())), next(iter(lb.values())))]
    else:
        common = [k for k in la if k in lb]
        if not common:
            raise ValueError(f"no load level in common: {sorted(la)} vs {sorted(lb)}")
        pairs = [(k, la[k], lb[k]) for k in common]
    return {
        "a": str(path_a),
        "b": str(path_b),
        "levels": [
            {
                "level": name,
                "rows": [
                    {"metric": m, "a": x, "b": y, "ratio_b_over_a": r} for m, x, y, r in compare_rows(sa, sb)
                ],
            }
            for name, sa, sb in pairs
        ],
    }


def print_comparison(console: Console, result: dict[str, Any]) -> None:
    def fmt(v: Any) -> str:
        if v is None:
            return "-"
        return f"{v:,.2f}" if isinstance(v, float) else str(v)

    for lv in result["levels"]:
        table = Table(title=f"{lv['level']}  (A = {result['a']}, B = {result['b']})", title_justify="left")
        for col in ("metric", "A", "B", "B / A"):
            table.add_column(col, justify="right" if col != "metric" else "left")
        for row in lv["rows"]:
            table.add_row(row["metric"], fmt(row["a"]), fmt(row["b"]), fmt(row["ratio_b_over_a"]))
        console.print(table)
