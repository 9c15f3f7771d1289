"""Write docs/performance.md, the page of current figures, from benchmarks/goals.toml and the results log
(benchmarks/results/*.jsonl, one line per benchmark run: benchmarks/results_log.py).

For each goal and each CPU the page shows the latest measurement only (the lines of the latest date), so
a figure is replaced by running its benchmark again, never by editing the page. The output depends on
nothing but those files (sorted, no time of generation), so a stale page is caught by comparing:

    python scripts/figures_page.py            # rewrite docs/performance.md
    python scripts/figures_page.py --check    # exit 1 if it differs from what would be written
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import tomllib
import unicodedata
from dataclasses import dataclass
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
GOALS = REPO / "benchmarks" / "goals.toml"
RESULTS = REPO / "benchmarks" / "results"
PAGE = REPO / "docs" / "performance.md"
DIARY = "docs/history/benchmarks.md"

GROUPS = {
    "peers": "Against peers: vLLM CPU and llama.cpp",
    "offline_served": "Offline and served",
    "quantization": "Quantization: speed and accuracy",
    "prefix_reuse": "Prefix reuse and offload",
    "speculative": "Speculative decoding and structured output",
    "distributed": "Distributed serving",
    "operations": "Watching it: tracing and the console",
    "triton": "KServe v2 / Triton models",
}


def slug(text: str) -> str:
    """The anchor MkDocs' toc extension gives a heading (its default slugify): inline code marks dropped,
    accents folded to ASCII, punctuation removed, lowercase, runs of spaces and hyphens to one hyphen."""
    text = re.sub(r"`([^`]*)`", r"\1", text)
    text = re.sub(r"[*_]{1,2}([^*_]+)[*_]{1,2}", r"\1", text)
    text = unicodedata.normalize("NFKD", text).encode("ascii", "ignore").decode("ascii")
    text = re.sub(r"[^\w\s-]", "", text).strip().lower()
    return re.sub(r"[-\s]+", "-", text)


def anchors(markdown: str) -> list[str]:
    """Every heading's anchor in document order, with the toc extension's "_1", "_2" for repeats."""
    seen: set[str] = set()
    out: list[str] = []
    in_code = False
    for line in markdown.splitlines():
        if line.startswith("```"):
            in_code = not in_code
        m = None if in_code else re.match(r"#{1,6}\s+(.*?)\s*#*\s*$", line)
        if not m:
            continue
        base = a = slug(m.group(1))
        n = 0
        while a in seen:
            n += 1
            a = f"{base}_{n}"
        seen.add(a)
        out.append(a)
    return out


@dataclass(frozen=True)
class Goal:
    id: str
    group: str
    title: str
    benchmark: str
    metric: str
    comparison: str
    threshold: float
    unit: str
    issue: int
    description: str
    cpus: str | None = None


def load_goals(path: Path = GOALS) -> list[Goal]:
    return [Goal(**g) for g in tomllib.loads(path.read_text())["goal"]]


def load_results(folder: Path = RESULTS) -> list[dict[str, Any]]:
    lines: list[dict[str, Any]] = []
    for path in sorted(folder.glob("*.jsonl")):
        lines += [json.loads(ln) for ln in path.read_text().splitlines() if ln.strip()]
    return lines


def cpu_name(line: dict[str, Any]) -> str:
    cpu = line.get("cpu") or {}
    name = cpu.get("label") or cpu.get("model_name") or "unknown CPU"
    return f"{name}, held to AVX2" if cpu.get("max_isa") == "avx2" else name


def is_avx2(line: dict[str, Any]) -> bool:
    """A CPU without AVX-512, or a run that held its kernels to AVX2."""
    cpu = line.get("cpu") or {}
    return cpu.get("max_isa") == "avx2" or "avx512" not in (cpu.get("isa") or [])


def values(v: Any) -> list[float]:
    """A figure's numbers: a number, a list of runs, or a range "a-b" the diary gives by its ends."""
    if isinstance(v, bool) or v is None:
        return []
    if isinstance(v, int | float):
        return [float(v)]
    if isinstance(v, list):
        return [x for item in v for x in values(item)]
    return [float(x) for x in re.findall(r"\d+(?:\.\d+)?", str(v))]


def fmt(v: Any, unit: str) -> str:
    if isinstance(v, list):
        return ", ".join(fmt(x, unit) for x in v)
    if isinstance(v, str):
        return v.replace("-", "–") + ("x" if unit == "x" else "")
    if unit == "x":
        return f"{v:.2f}x"
    if unit == "%":
        return f"{v:+.2f}%"
    if unit == "share":
        return f"{v:.0%}" if v <= 1.5 else f"{v:.2f}"
    if unit == "/s":
        return f"{v:,.0f}/s"
    return f"{v:g} {unit}"


def holds(goal: Goal, figures: list[float]) -> str:
    met = [x >= goal.threshold if goal.comparison == ">=" else x <= goal.threshold for x in figures]
    if not met:
        return "—"
    if all(met):
        return "yes"
    return "no" if not any(met) else f"in {sum(met)} of {len(met)}"


def latest_per_cpu(goal: Goal, lines: list[dict[str, Any]]) -> dict[str, list[dict[str, Any]]]:
    """Per CPU, the lines of the latest date that carry the goal's metric (transcribed lines without a
    date count as oldest). Several lines of one date are one sitting's runs, shown together."""
    by_cpu: dict[str, list[dict[str, Any]]] = {}
    for ln in lines:
        if ln.get("benchmark") != goal.benchmark or ln.get("metrics", {}).get(goal.metric) is None:
            continue
        if (goal.cpus == "avx2") != is_avx2(ln) and goal.cpus is not None:
            continue
        by_cpu.setdefault(cpu_name(ln), []).append(ln)
    out = {}
    for cpu, group in by_cpu.items():
        last = max(ln.get("date") or "" for ln in group)
        out[cpu] = [ln for ln in group if (ln.get("date") or "") == last]
    return out


def source_cell(line: dict[str, Any]) -> str:
    src = line.get("source")
    if not src:
        return "this log"
    if src.startswith(DIARY + "#"):
        return f"[diary](history/benchmarks.md#{src.split('#', 1)[1]})"
    return src


def note(line: dict[str, Any], metric: str) -> str:
    """A line's note on this metric: notes are a string for the whole run, or one per metric."""
    n = line.get("notes") or ""
    return n.get(metric, "") if isinstance(n, dict) else n


def cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def short(goal: Goal, group: list[dict[str, Any]]) -> str:
    """A figure for the summary: the number, or the range of a sitting's runs."""
    flat = [x for ln in group for x in values(ln["metrics"][goal.metric])]
    if not flat:
        return "—"
    lo, hi = min(flat), max(flat)
    return fmt(lo, goal.unit) if lo == hi else f"{fmt(lo, goal.unit)}–{fmt(hi, goal.unit)}"


MARK = {"yes": "✓", "no": "✗", "—": ""}


def summary(goals: list[Goal], lines: list[dict[str, Any]]) -> list[str]:
    """One row per goal, one column per CPU: the latest figure and whether it holds, linked to its table."""
    latest = {g.id: latest_per_cpu(g, lines) for g in goals}
    cpus = sorted({cpu for per in latest.values() for cpu in per})
    legend = "The latest figure per CPU; ✓ the goal holds, ✗ it does not. Details below."
    out = ["## At a glance", "", legend, ""]
    out += ["| goal | " + " | ".join(cpus) + " |", "|---" * (len(cpus) + 1) + "|"]
    for g in goals:
        sign = "≥" if g.comparison == ">=" else "≤"
        row = [f"[{cell(g.title)}](#{slug(g.title)}) ({sign} {fmt(g.threshold, g.unit)})"]
        for cpu in cpus:
            group = latest[g.id].get(cpu)
            if not group:
                row.append("")
                continue
            verdict = holds(g, [x for ln in group for x in values(ln["metrics"][g.metric])])
            row.append(f"{short(g, group)} {MARK.get(verdict, verdict)}".strip())
        out.append("| " + " | ".join(row) + " |")
    return [*out, ""]


def goal_section(goal: Goal, lines: list[dict[str, Any]]) -> list[str]:
    sign = "≥" if goal.comparison == ">=" else "≤"
    want = f"{sign} {fmt(goal.threshold, goal.unit)}"
    scope = {"avx2": " On CPUs without AVX-512, or held to AVX2.", "avx512": " On CPUs with AVX-512."}.get(
        goal.cpus or "", ""
    )
    out = [f"### {goal.title}", "", f"{goal.description}{scope} Goal: **{want}** (issue #{goal.issue}).", ""]
    latest = latest_per_cpu(goal, lines)
    if not latest:
        return [*out, "Not yet measured.", ""]
    out += ["| CPU | figure | holds | date | commit | source |", "|---" * 6 + "|"]
    commands: list[str] = []
    for cpu in sorted(latest):
        group = latest[cpu]
        figures = [ln["metrics"][goal.metric] for ln in group]
        shown = fmt(figures[0] if len(figures) == 1 else figures, goal.unit)
        flat = [x for f in figures for x in values(f)]
        date = (group[0].get("date") or "—")[:10]
        commits = sorted({ln.get("commit") or "—" for ln in group})
        sources = sorted({source_cell(ln) for ln in group})
        notes = sorted({n for ln in group if (n := note(ln, goal.metric))})
        figure = shown + (f" ({'; '.join(notes)})" if notes else "")
        row = [cpu, figure, holds(goal, flat), date, ", ".join(commits), ", ".join(sources)]
        out.append("| " + " | ".join(cell(x) if i != 5 else x for i, x in enumerate(row)) + " |")
        # Commands go under the table: a long one in a narrow column wraps a letter a line.
        runs = sorted({ln.get("command") for ln in group if ln.get("command")})
        commands += [f"- {cpu}: `{c}`" for c in runs]
    if commands:
        out += ["", "Commands:", "", *commands]
    return [*out, ""]


# `make run`'s four steps, as it numbers them ("==> [k/4] ..."), and what the last one ends with.
STEPS = ("virtualenv", "packages", "model", "kernels, then the server's start")


def steps_cell(metrics: dict[str, Any]) -> str:
    """Seconds per step of `make run`, from the times its step lines were printed."""
    starts = [metrics.get(f"seconds_at_step_{k}_of_{len(STEPS)}") for k in range(1, len(STEPS) + 1)]
    end = metrics.get("seconds_to_first_answer")
    if None in starts or end is None:
        return "—"
    bounds = [*starts, end]
    return ", ".join(f"{name} {bounds[i + 1] - bounds[i]:.0f} s" for i, name in enumerate(STEPS))


def first_answer_section(lines: list[dict[str, Any]]) -> list[str]:
    out = ["## First answer from a fresh clone", ""]
    rows = [ln for ln in lines if ln.get("benchmark") == "first_answer"]
    out += [
        "Seconds from `make run` in a fresh clone (virtualenv, packages, weights, kernels built) to the "
        "first answer of a chat request, tried as a new user would.",
        "",
    ]
    if not rows:
        return [*out, "Not yet measured.", ""]
    out += ["| CPU | seconds | where they went | date | commit | notes | source |", "|---" * 7 + "|"]
    for ln in sorted(rows, key=lambda r: (cpu_name(r), r.get("date") or "")):
        secs = ln["metrics"].get("seconds_to_first_answer")
        row = [
            cpu_name(ln), "—" if secs is None else f"{secs:g}", steps_cell(ln["metrics"]),
            (ln.get("date") or "—")[:10], ln.get("commit") or "—", note(ln, "seconds_to_first_answer"),
            source_cell(ln),
        ]  # fmt: skip
        out.append("| " + " | ".join(cell(x) for x in row) + " |")
    return [*out, ""]


INTRO = """# Performance

The current figure of every goal the project has set, per CPU, generated from the results log by
`scripts/figures_page.py`; do not edit this page by hand.

**How a figure is made.** Each benchmark measures its baseline in the same run (Hugging Face `generate`,
vLLM's CPU build, llama.cpp's server, plain decoding, recomputing, the float32 model) and the figure is
the ratio: these machines are shared and drift by 10-15% from hour to hour, ratios much less. Each row
is the latest measurement on that CPU, with its date, commit and command. The machines have 2 cores;
every figure is for SmolLM2-135M unless its command names another model. Rows whose source is the
*diary* were transcribed from [the benchmark diary](history/benchmarks.md), not re-run; a "—" is
something the diary does not say.

**How to add one.** Run the benchmark (its command is in the table); it appends a line to
`benchmarks/results/<benchmark>.jsonl` with the CPU, commit, date and command (`--no-record` or
`TOKENMILL_NO_RECORD=1` for a trial run). Then `python scripts/figures_page.py` and commit both.
"""


def render(goals: list[Goal], lines: list[dict[str, Any]]) -> str:
    out = [INTRO]
    missing = [g for g in goals if not latest_per_cpu(g, lines)]
    if missing:
        out += ["**Not yet measured:** " + ", ".join(g.title for g in missing) + ".", ""]
    out += summary(goals, lines)
    for key, heading in GROUPS.items():
        members = [g for g in goals if g.group == key]
        if members:
            out += [f"## {heading}", ""]
            for g in members:
                out += goal_section(g, lines)
    out += first_answer_section(lines)
    return "\n".join(out).rstrip("\n") + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--check", action="store_true", help="exit 1 if the page is not what would be written")
    ap.add_argument("--output", type=Path, default=PAGE)
    args = ap.parse_args(argv)
    goals, lines = load_goals(), load_results()
    unknown = sorted({g.group for g in goals} - set(GROUPS))
    if unknown:
        sys.exit(f"goals.toml: unknown group(s) {unknown}")
    text = render(goals, lines)
    if args.check:
        if not args.output.exists() or args.output.read_text() != text:
            print(f"{args.output.relative_to(REPO)} is stale: run python scripts/figures_page.py")
            return 1
        return 0
    args.output.write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
