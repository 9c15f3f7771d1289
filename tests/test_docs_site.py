"""The front door: README.md stays short and its links resolve; the documentation site builds strictly.

`mkdocs build --strict` with mkdocs.yml's `validation` settings fails on a broken link, a missing anchor
or a page left out of the nav, so a guide that points at a renamed page fails here, not in a reader's
browser. The generated pages (CLI, configuration, HTTP API, figures) are checked for staleness by their
own tests (test_docs_reference.py, test_figures_page.py).
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
MAX_README_CHARS = 10_000
MAX_CELL_CHARS = 300
LINK = re.compile(r"\]\(([^)\s]+)\)")


def test_readme_fits_in_three_screens() -> None:
    text = README.read_text(encoding="utf-8")
    assert len(text) <= MAX_README_CHARS, f"README.md is {len(text)} characters (at most {MAX_README_CHARS})"
    for number, line in enumerate(text.splitlines(), 1):
        if not line.startswith("|"):
            continue
        for cell in line.strip().strip("|").split("|"):
            assert len(cell.strip()) <= MAX_CELL_CHARS, f"README.md line {number}: a long cell"


def test_readme_links_resolve() -> None:
    links = LINK.findall(README.read_text(encoding="utf-8"))
    local = [link for link in links if not link.startswith(("http://", "https://", "#"))]
    assert local, "the README links to its guides"
    missing = [link for link in local if not (ROOT / link.split("#")[0]).exists()]
    assert not missing, f"README.md links to files that do not exist: {missing}"


def test_every_readme_feature_row_links_its_guide() -> None:
    rows = [line for line in README.read_text(encoding="utf-8").splitlines() if line.startswith("| ")]
    features = [row for row in rows[1:] if not row.startswith("|---")]
    assert features, "the README has a feature table"
    for row in features:
        assert "](docs/" in row, f"a feature row without a guide: {row[:60]}"


def test_the_site_builds_strictly(tmp_path: Path) -> None:
    pytest.importorskip("mkdocs", reason="the docs extra is not installed: pip install -e '.[docs]'")
    pytest.importorskip("material", reason="the docs extra is not installed: pip install -e '.[docs]'")
    done = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(tmp_path / "site")],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    output = f"{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
    assert done.returncode == 0, f"mkdocs build --strict failed:\n{output}"
    assert (tmp_path / "site" / "index.html").is_file()
    assert (tmp_path / "site" / "performance" / "index.html").is_file()
