"""report.html: a bench run (one level, a sweep, a goodput search) or a comparison of two runs, in one
file that opens anywhere and can be sent on: no script, font or image is fetched, plots are PNGs inside
the page (data: URLs), and a Content-Security-Policy forbids the browser to load anything else.

Every value is escaped; the configuration shown is the run's with credentials masked. The summary
tables' cells carry data-key (and, in a sweep, data-level), the path of the summary.json value they
show, so that a reader (or a test) can hold each cell against summary.json.
"""

from __future__ import annotations

import base64
import html
import re
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any
from urllib.parse import parse_qsl, urlencode, urlsplit, urlunsplit

from tokenmill.bench.compare import levels
from tokenmill.bench.report import (
    CURVE_PNG,
    LEGEND,
    STAT_KEYS,
    TABLE_METRICS,
    curve_figure,
    distribution_figure,
    fmt,
    png_bytes,
)
from tokenmill.bench.runner import BenchResult, LevelResult

REPORT = "report.html"
MASK = "********"
SECRET_NAME = re.compile(r"key|token|secret|passw|authori[sz]ation|credential|cookie", re.IGNORECASE)
MAX_ERROR_SAMPLES, MAX_DETAIL_CHARS = 5, 300

# The page asks for nothing outside itself: inline styles and data: images only.
CSP = "default-src 'none'; img-src data:; style-src 'unsafe-inline'"
STYLE = """
body { font: 14px/1.45 system-ui, sans-serif; margin: 2em auto; max-width: 72em; padding: 0 1em; }
h1 { font-size: 1.5em; } h2 { font-size: 1.2em; margin-top: 2em; border-bottom: 1px solid #ccc; }
table { border-collapse: collapse; margin: 0.6em 0; }
th, td { border: 1px solid #ddd; padding: 0.2em 0.6em; text-align: left; vertical-align: top; }
td.num { text-align: right; font-variant-numeric: tabular-nums; }
th { background: #f3f3f3; } tr.diff td { background: #fff6dd; }
img { max-width: 100%; } .note { color: #666; font-size: 0.9em; } .bad { color: #b00; font-weight: bold; }
"""


# -- building blocks (shared with tokenmill/sizing/html_report.py) -------------------------------------
def esc(value: Any) -> str:
    return html.escape(str(value), quote=True)


def page(title: str, body: Iterable[str]) -> str:
    return (
        '<!DOCTYPE html>\n<html lang="en">\n<head>\n<meta charset="utf-8">\n'
        f'<meta http-equiv="Content-Security-Policy" content="{CSP}">\n'
        f"<title>{esc(title)}</title>\n<style>{STYLE}</style>\n</head>\n<body>\n"
        + "\n".join(body)
        + "\n</body>\n</html>\n"
    )


def td(
    value: Any = None,
    key: str | None = None,
    level: str | None = None,
    text: str | None = None,
    spec: str | None = None,
) -> str:
    """A cell: `text` as given, or a number (right-aligned) formatted by the format `spec` or, without
    one, as the console tables show it. `key`, `level` and `spec` are kept as data- attributes."""
    attrs = "" if key is None else f' data-key="{esc(key)}"'
    attrs += "" if level is None else f' data-level="{esc(level)}"'
    if text is not None:
        return f"<td{attrs}>{esc(text)}</td>"
    if spec is not None:
        attrs += f' data-format="{esc(spec)}"'
    shown = fmt(value) if spec is None or value is None else format(value, spec)
    return f'<td class="num"{attrs}>{esc(shown)}</td>'


def table(
    head: Iterable[str], rows: Iterable[Iterable[str]], cls: str = "", row_cls: Iterable[str] = ()
) -> str:
    """`rows` hold cells made by td(); `row_cls` a class per row (e.g. "diff")."""
    marks = list(row_cls)
    out = [
        f'<table class="{esc(cls)}">' if cls else "<table>",
        "<tr>" + "".join(f"<th>{esc(h)}</th>" for h in head) + "</tr>",
    ]
    for i, cells in enumerate(rows):
        mark = f' class="{esc(marks[i])}"' if i < len(marks) and marks[i] else ""
        out.append(f"<tr{mark}>" + "".join(cells) + "</tr>")
    out.append("</table>")
    return "\n".join(out)


def img(png: bytes | None, alt: str) -> str:
    if not png:
        return f'<p class="note">{esc(alt)}: nothing to plot.</p>'
    return (
        f'<p><img alt="{esc(alt)}" src="data:image/png;base64,{base64.b64encode(png).decode("ascii")}"></p>'
    )


def para(text: str, cls: str = "") -> str:
    return f'<p class="{esc(cls)}">{esc(text)}</p>' if cls else f"<p>{esc(text)}</p>"


def _secret(name: str, value: Any) -> bool:
    n = name.lower()
    # The tokenizer's description and counts of tokens (prefix_tokens, max_tokens) name no credential.
    if n == "tokenizer" or (isinstance(value, int | float) and not isinstance(value, bool) and "tokens" in n):
        return False
    return bool(SECRET_NAME.search(n))


def _mask_url(url: str) -> str:
    """A URL without the password of its user part and the values of credential-like query parameters."""
    try:
        parts = urlsplit(url)
        host = parts.netloc
        if parts.password is not None:
            host = f"{parts.username}:{MASK}@{host.rsplit('@', 1)[1]}"
        query = urlencode(
            [(k, MASK if _secret(k, v) else v) for k, v in parse_qsl(parts.query, True)], safe="*"
        )
        return urlunsplit((parts.scheme, host, parts.path, query, parts.fragment))
    except ValueError:  # not a URL after all (a port that is not a number...): shown masked, to be safe
        return MASK


def masked(value: Any, name: str = "") -> Any:
    """A copy of a configuration with every credential masked: values under names that say key, token,
    secret, password or authorization, and the secret parts of URLs."""
    if name and _secret(name, value) and value not in (None, "", [], {}):
        return MASK
    if isinstance(value, Mapping):
        return {k: masked(v, str(k)) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [masked(v) for v in value]
    if isinstance(value, str) and value.startswith(("http://", "https://")):
        return _mask_url(value)
    return value


def flatten(d: Mapping[str, Any], prefix: str = "") -> list[tuple[str, Any]]:
    """Nested settings as dotted names (workload.isl), in their order; lists and empty dicts as values."""
    rows: list[tuple[str, Any]] = []
    for k, v in d.items():
        name = f"{prefix}{k}"
        if isinstance(v, Mapping) and v:
            rows += flatten(v, name + ".")
        else:
            rows.append((name, v))
    return rows


def _setting(v: Any) -> str:
    if v is None:
        return "-"
    if isinstance(v, list | tuple):
        return ", ".join(str(x) for x in v) or "-"
    if isinstance(v, Mapping):
        return "-"  # an empty one: non-empty mappings were flattened
    return str(v)


def config_table(config: Mapping[str, Any]) -> str:
    return table(
        ("setting", "value"), ([td(text=k), td(text=_setting(v))] for k, v in flatten(masked(config)))
    )


# -- one run ---------------------------------------------------------------------------------------------
TOTALS = (
    ("completed", "completed requests"),
    ("failed", "failed requests"),
    ("cancelled_at_end", "cancelled at the end"),
    ("duration_s", "duration s"),
    ("request_throughput", "requests/s"),
    ("output_token_throughput", "output tokens/s"),
    ("input_token_throughput", "input tokens/s"),
    ("goodput", "goodput req/s"),
    ("slo_attainment", "share meeting every SLO"),
    ("arrival_rate", "arrival rate req/s"),
    ("completion_rate", "completion rate req/s"),
    ("client_cpu_pct", "load generator CPU % of a core"),
)
SWEEP_COLUMNS = (
    ("completed", "ok"),
    ("failed", "failed"),
    ("cancelled_at_end", "cancelled"),
    ("request_throughput", "req/s"),
    ("output_token_throughput", "out tok/s"),
    ("ttft_ms.p50", "TTFT p50 ms"),
    ("ttft_ms.p99", "TTFT p99 ms"),
    ("itl_ms.p50", "ITL p50 ms"),
    ("itl_ms.p99", "ITL p99 ms"),
    ("e2e_ms.p50", "E2E p50 ms"),
    ("e2e_ms.p99", "E2E p99 ms"),
    ("tps_user.p50", "tok/s/user p50"),
    ("goodput", "goodput req/s"),
)


def value_at(summary: Mapping[str, Any], key: str) -> Any:
    """summary["ttft_ms"]["p50"] for "ttft_ms.p50" (a number picks a list's item); None where a part is
    missing."""
    v: Any = summary
    for part in key.split("."):
        if isinstance(v, Mapping):
            v = v.get(part)
        elif isinstance(v, list) and part.isdigit() and int(part) < len(v):
            v = v[int(part)]
        else:
            return None
    return v


def _totals(s: Mapping[str, Any], level: str | None) -> str:
    rows = [[td(text=name), td(s.get(k), k, level)] for k, name in TOTALS if k in s]
    return table(("", "value"), rows, "summary")


def _stats(s: Mapping[str, Any], level: str | None) -> str:
    rows = [
        [td(text=name), *(td(s[m].get(k), f"{m}.{k}", level) for k in STAT_KEYS)]
        for m, name in TABLE_METRICS
        if s.get(m)
    ]
    if not rows:
        return para("No latency statistics: no request completed, or the run did not stream.", "note")
    return table(("metric", *STAT_KEYS), rows, "summary")


def _errors(lv: LevelResult) -> str:
    s = lv.summary
    parts = []
    if s["completed"] == 0:
        parts.append(para(f"{s['label']}: no request completed.", "bad"))
    if s.get("cancelled_at_end"):
        parts.append(
            para(f"{s['cancelled_at_end']} still running after the duration and grace period, cancelled.")
        )
    if not s["failed"]:
        parts.append(para("No request failed."))
        return "\n".join(parts)
    parts.append(para(f"{s['failed']} requests failed.", "bad"))
    parts.append(table(("kind", "requests"), ([td(text=k), td(n)] for k, n in s["errors"].items())))
    samples: list[tuple[str, str]] = []
    for r in lv.records:
        if r.error and r.error != "cancelled" and r.error_detail:
            sample = (r.error, r.error_detail[:MAX_DETAIL_CHARS])
            if sample not in samples:
                samples.append(sample)
        if len(samples) == MAX_ERROR_SAMPLES:
            break
    if samples:
        parts.append(
            table(("kind", "first distinct details"), ([td(text=k), td(text=d)] for k, d in samples))
        )
    return "\n".join(parts)


def _level_section(lv: LevelResult, plot: bytes | None, level: str | None, heading: str) -> list[str]:
    s = lv.summary
    return [
        heading,
        _totals(s, level),
        _stats(s, level),
        img(plot, f"{s['label']}: latency distributions"),
        "<h3>Errors</h3>" if level is None else f"<h4>{esc(s['label'])}: errors</h4>",
        _errors(lv),
    ]


def _sweep_table(runs: list[LevelResult]) -> str:
    rows = []
    for lv in runs:
        s, label = lv.summary, lv.summary["label"]
        load = "concurrency" if s.get("concurrency") is not None else "request_rate"
        rows.append(
            [td(None, "label", label, text=label), td(s.get(load), load, label)]
            + [td(value_at(s, k), k, label) for k, _ in SWEEP_COLUMNS]
        )
    return table(
        ("level", "concurrency or req/s", *(name for _, name in SWEEP_COLUMNS)), rows, "summary sweep"
    )


def _search_section(search: Mapping[str, Any]) -> list[str]:
    best = search.get("max_good_rate")
    rows = [
        [
            td(p["request_rate"]),
            td(p["slo_attainment"]),
            td(p["goodput"]),
            td(text="yes" if p["keeps_up"] else "no"),
        ]
        for p in search.get("probes", [])
    ]
    return [
        "<h2>Goodput search</h2>",
        para(
            f"Highest request rate with at least {100 * search['target_attainment']:.0f}% of requests "
            "meeting every SLO: "
            + (f"{fmt(float(best))} req/s." if best is not None else "none of the rates tried.")
        ),
        table(("request rate", "SLO attainment", "goodput req/s", "kept up"), rows),
    ]


def write_html(
    out: Path, result: BenchResult, config: Mapping[str, Any], plots: Mapping[str, bytes | None] | None = None
) -> Path:
    """Write out/report.html for a run; return its path. `plots` are the PNGs write_artifacts drew (by level
    label, and CURVE_PNG for a sweep's curve); without them they are drawn here."""
    if plots is None:
        plots = {lv.summary["label"]: _png(distribution_figure(lv)) for lv in result.levels}
        if len(result.levels) > 1 or result.search is not None:
            plots = {**plots, CURVE_PNG: _png(curve_figure([("", [lv.summary for lv in result.levels])]))}
    single = len(result.levels) == 1 and result.search is None
    title = f"tokenmill bench: {config.get('model') or 'model'}" + (
        f", {result.levels[0].summary['label']}" if single else f", {len(result.levels)} levels"
    )
    cfg = dict(config)
    if single:
        cfg["load"] = result.levels[0].load.__dict__
    body = [f"<h1>{esc(title)}</h1>", "<h2>Configuration</h2>", config_table(cfg)]
    if single:
        lv = result.levels[0]
        body += _level_section(lv, plots.get(lv.summary["label"]), None, "<h2>Summary</h2>")
    else:
        body += ["<h2>Summary</h2>", _sweep_table(result.levels)]
        body.append(
            img(
                plots.get(CURVE_PNG), "throughput vs interactivity: output tokens/s against tokens/s per user"
            )
        )
        if result.search is not None:
            body += _search_section(result.search)
        body.append("<h2>Levels</h2>")
        for lv in result.levels:
            label = lv.summary["label"]
            body += _level_section(lv, plots.get(label), label, f"<h3>{esc(label)}</h3>")
    body.append(para(LEGEND, "note"))
    path = out / REPORT
    path.write_text(page(title, body), encoding="utf-8")
    return path


def _png(fig: Any) -> bytes | None:
    return None if fig is None else png_bytes(fig)


# -- two runs --------------------------------------------------------------------------------------------
def write_compare_html(
    path: Path, comparison: Mapping[str, Any], a: Mapping[str, Any], b: Mapping[str, Any]
) -> Path:
    """Write `tokenmill bench compare`'s result as HTML: both configurations side by side (differences
    marked), the metrics with B/A ratios per level, and both throughput-versus-interactivity curves
    on one plot. `a` and `b` are the summaries compared (compare.load_summary)."""
    name_a, name_b = str(comparison["a"]), str(comparison["b"])
    body = [
        "<h1>tokenmill bench compare</h1>",
        table(
            ("run", "summary"), ([td(text="A (baseline)"), td(text=name_a)], [td(text="B"), td(text=name_b)])
        ),
        para(
            "B / A below 1: B is faster (latencies) or does less (throughputs); above 1 the reverse.", "note"
        ),
        "<h2>Configuration</h2>",
    ]
    ca, cb = dict(flatten(masked(a.get("config") or {}))), dict(flatten(masked(b.get("config") or {})))
    keys = list(ca) + [k for k in cb if k not in ca]
    body.append(
        table(
            ("setting", "A", "B"),
            ([td(text=k), td(text=_setting(ca.get(k))), td(text=_setting(cb.get(k)))] for k in keys),
            row_cls=("diff" if ca.get(k) != cb.get(k) else "" for k in keys),
        )
    )
    body.append("<h2>Metrics</h2>")
    for lv in comparison["levels"]:
        body.append(f"<h3>{esc(lv['level'])}</h3>")
        rows = [
            [
                td(text=r["metric"]),
                td(r["a"], "a"),
                td(r["b"], "b"),
                td(r["ratio_b_over_a"], "ratio_b_over_a"),
            ]
            for r in lv["rows"]
        ]
        body.append(table(("metric", "A", "B", "B / A"), rows, "summary compare"))
    body.append("<h2>Throughput vs interactivity</h2>")
    fig = curve_figure([("A", list(levels(dict(a)).values())), ("B", list(levels(dict(b)).values()))])
    body.append(img(_png(fig), "throughput vs interactivity, A and B overlaid"))
    body.append(para(LEGEND, "note"))
    path.write_text(page(f"tokenmill bench compare: {name_a} vs {name_b}", body), encoding="utf-8")
    return path
