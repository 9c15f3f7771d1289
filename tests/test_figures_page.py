"""The page of current figures (docs/performance.md) against the results log it is generated from."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "scripts"))
sys.path.insert(0, str(REPO / "benchmarks"))

import figures_page  # noqa: E402
import results_log  # noqa: E402


def test_the_committed_page_is_the_generated_one() -> None:
    assert figures_page.main(["--check"]) == 0, "run: python scripts/figures_page.py"


def test_record_appends_one_well_formed_line(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(results_log, "RESULTS_DIR", tmp_path)
    monkeypatch.delenv("TOKENMILL_NO_RECORD", raising=False)
    for ratio in (3.1, 3.2):
        results_log.record("trial", {"throughput_ratio": ratio, "arithmetic": "bfloat16"}, command="x --y")
    lines = [json.loads(ln) for ln in (tmp_path / "trial.jsonl").read_text().splitlines()]
    assert [ln["metrics"]["throughput_ratio"] for ln in lines] == [3.1, 3.2]
    line = lines[0]
    assert line["benchmark"] == "trial" and line["command"] == "x --y" and line["source"] is None
    assert line["date"].endswith("Z") and line["python"]
    assert {"label", "model_name", "family", "model", "isa", "max_isa"} <= set(line["cpu"])
    assert line["commit"] is None or len(line["commit"].removesuffix("-dirty")) >= 7


def test_record_is_skipped_on_request_and_survives_a_missing_git(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(results_log, "RESULTS_DIR", tmp_path)
    monkeypatch.setenv("TOKENMILL_NO_RECORD", "1")
    assert results_log.record("trial", {"x": 1}) is None
    monkeypatch.delenv("TOKENMILL_NO_RECORD")
    monkeypatch.setenv("PATH", str(tmp_path))  # no git (nor lscpu) on the path
    assert results_log.git_commit() is None
    assert results_log.record("trial", {"x": 1}, max_isa="avx2") is not None
    line = json.loads((tmp_path / "trial.jsonl").read_text())
    assert line["commit"] is None and line["cpu"]["max_isa"] == "avx2"


def test_every_goal_is_measured_or_said_not_to_be() -> None:
    goals, lines = figures_page.load_goals(), figures_page.load_results()
    page = figures_page.PAGE.read_text()
    assert len({g.id for g in goals}) == len(goals)
    for g in goals:
        measured = figures_page.latest_per_cpu(g, lines)
        section = page.split(f"### {g.title}\n", 1)[1].split("\n### ", 1)[0]
        if measured:
            assert "| CPU | figure |" in section, g.id
        else:
            assert "Not yet measured." in section and g.title in page.split("\n## ", 1)[0], g.id


def test_an_unmeasured_goal_is_listed_not_dropped(tmp_path: Path) -> None:
    goal = figures_page.Goal("g", "peers", "A goal nobody ran", "none", "m", ">=", 2.0, "x", 1, "d.")
    page = figures_page.render([goal], [])
    assert "**Not yet measured:** A goal nobody ran." in page and "Not yet measured." in page


def test_latest_date_per_cpu_wins_and_held_to_avx2_is_its_own_row() -> None:
    goal = figures_page.Goal("g", "peers", "T", "b", "m", ">=", 2.0, "x", 1, "d.")
    cpu = {"label": "AMD Zen 4", "isa": ["avx2", "avx512"], "max_isa": None}

    def line(date: str, v: float, **cpu_extra: object) -> dict:
        return {"benchmark": "b", "metrics": {"m": v}, "cpu": {**cpu, **cpu_extra}, "date": date}

    rows = [line("2026-11-23", 1.0), line("2026-11-28", 2.5), line("2026-11-29", 1.5, max_isa="avx2")]
    latest = figures_page.latest_per_cpu(goal, rows)
    assert {k: [r["metrics"]["m"] for r in v] for k, v in latest.items()} == {
        "AMD Zen 4": [2.5],
        "AMD Zen 4, held to AVX2": [1.5],
    }
    assert figures_page.holds(goal, [2.5]) == "yes" and figures_page.holds(goal, [1.0, 3.0]) == "in 1 of 2"


def test_transcribed_lines_link_to_headings_that_exist() -> None:
    anchors = set(figures_page.anchors((REPO / figures_page.DIARY).read_text()))
    for line in figures_page.load_results():
        src = line.get("source") or ""
        if src.startswith(figures_page.DIARY + "#"):
            assert src.split("#", 1)[1] in anchors, src


def test_anchors_follow_mkdocs_toc() -> None:
    assert figures_page.slug("`tokenmill bench` against tokenmill (issue #4)") == (
        "tokenmill-bench-against-tokenmill-issue-4"
    )
    assert figures_page.anchors("# A\n## A\n```\n# not a heading\n```\n## A") == ["a", "a_1", "a_2"]
