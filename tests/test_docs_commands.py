"""Every `tokenmill ...` command shown in the README and the guides names a real command and real flags.

The guides are read by people who copy their examples; a flag renamed in the CLI and left in a guide is
an error they meet first. This walks each ```bash block of README.md and docs/ (the diary under
docs/history/ is a record of its time and is left out; the generated references are checked against
the app by test_docs_reference.py), finds the `tokenmill` commands, and checks each against the typer
app's click tree: the subcommand path exists and each `--flag` is one of its options.
"""

from __future__ import annotations

import re
import shlex
from pathlib import Path
from typing import Any

import pytest
import typer

from tokenmill.cli.main import app

ROOT = Path(__file__).resolve().parent.parent
BLOCK = re.compile(r"```bash\n(.*?)```", re.DOTALL)


def pages() -> list[Path]:
    docs = [p for p in sorted((ROOT / "docs").rglob("*.md")) if p.parts[-2] not in {"history", "reference"}]
    return [ROOT / "README.md", *docs]


def commands(page: Path) -> list[tuple[int, list[str]]]:
    """(line number, argv) of each `tokenmill` command in the page's bash blocks, continuations joined."""
    text = page.read_text(encoding="utf-8")
    found: list[tuple[int, list[str]]] = []
    for block in BLOCK.finditer(text):
        first_line = text.count("\n", 0, block.start(1)) + 1
        joined = block.group(1).replace("\\\n", " ")
        for offset, line in enumerate(joined.splitlines()):
            line = line.strip()
            if line.startswith("tokenmill "):
                found.append((first_line + offset, shlex.split(line, comments=True)))
    return found


def is_group(command: Any) -> bool:
    # Duck-typed: typer's commands are not instances of the click package's classes in every version.
    return hasattr(command, "get_command") and hasattr(command, "list_commands")


def options(command: Any) -> set[str]:
    return {name for p in command.params for name in (*p.opts, *p.secondary_opts)} | {"--help"}


ROOT_COMMAND = typer.main.get_command(app)
CASES = [(page, number, argv) for page in pages() for number, argv in commands(page)]


def test_the_pages_show_commands() -> None:
    assert len(CASES) > 50, "the guides' examples were not found: has the code-block format changed?"


@pytest.mark.parametrize(
    ("page", "number", "argv"), CASES, ids=[f"{p.relative_to(ROOT)}:{n}" for p, n, _ in CASES]
)
def test_a_shown_command_is_real(page: Path, number: int, argv: list[str]) -> None:
    command: Any = ROOT_COMMAND
    words = argv[1:]
    while is_group(command) and words and not words[0].startswith("-"):
        sub = command.get_command(command.context_class(command), words[0])
        if sub is None:
            break  # an argument of the group's default command, e.g. a prompt
        command, words = sub, words[1:]
    where = f"{page.relative_to(ROOT)}:{number}: {shlex.join(argv)}"
    # A group that runs without a subcommand (bench, size) takes options of its own.
    stray = is_group(command) and words and not words[0].startswith("-")
    assert not stray, f"{where}: no such subcommand {words[0]!r}"
    unknown = [
        w.split("=", 1)[0] for w in words if w.startswith("--") and w.split("=", 1)[0] not in options(command)
    ]
    assert not unknown, f"{where}: unknown flag(s) {unknown}"
