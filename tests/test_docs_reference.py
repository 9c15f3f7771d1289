"""The generated reference pages are current, and help opens with what matters (issue 53)."""

from __future__ import annotations

import importlib.util
import re
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType

import pytest
import typer
import yaml
from typer.testing import CliRunner

from tokenmill.cli.config_options import tree_from_mapping
from tokenmill.cli.main import app
from tokenmill.server.config import ServerConfig

ROOT = Path(__file__).resolve().parent.parent
WIDE = {"COLUMNS": "200"}  # one option a line: what is checked is the layout, not the wrapping


def _script() -> ModuleType:
    spec = importlib.util.spec_from_file_location("docs_reference", ROOT / "scripts" / "docs_reference.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _help(*args: str) -> str:
    result = CliRunner().invoke(app, [*args], env=WIDE)
    assert result.exit_code == 0, result.output
    return result.output


def _command_paths() -> Iterator[list[str]]:
    """Every command and sub-command, as the arguments that reach it."""
    root = typer.main.get_command(app)

    def walk(cmd: object, path: list[str], ctx: typer.Context) -> Iterator[list[str]]:
        yield path
        if hasattr(cmd, "list_commands"):
            for name in cmd.list_commands(ctx):  # type: ignore[attr-defined]
                sub = cmd.get_command(ctx, name)  # type: ignore[attr-defined]
                yield from walk(sub, [*path, name], typer.Context(sub, info_name=name, parent=ctx))

    yield from walk(root, [], typer.Context(root, info_name="tokenmill"))


def test_the_committed_pages_are_what_the_script_writes(capsys: pytest.CaptureFixture[str]) -> None:
    code = _script().main(["--check"])
    assert code == 0, capsys.readouterr().err


def test_a_stale_page_is_named(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    script = _script()
    monkeypatch.setattr(script, "OUT", tmp_path)  # an empty folder: every page is missing
    monkeypatch.setattr(script, "PAGES", {"cli.md": script.PAGES["cli.md"]})
    assert script.stale_pages() == ["docs/reference/cli.md"]
    assert script.main([]) == 0 and script.stale_pages() == []
    page = (tmp_path / "cli.md").read_text()
    assert page.startswith("<!-- Generated") and "\x1b[" not in page and str(ROOT) not in page


def test_serve_help_opens_with_the_model_and_points_to_the_rest() -> None:
    short = _help("serve", "--help")
    lines = short.splitlines()
    assert any("--model " in line for line in lines[:25]), "\n".join(lines[:25])
    full = _help("serve", "--help-all")
    assert "--planner-interval-s" in full and "--planner-interval-s" not in short
    # the last words of the short help say how many more there are, where, and how to see them
    assert re.search(
        r"\d+ more options in .*Fleet and router.*: run `.*serve --help-all`\.$", " ".join(short.split())
    )


def test_worker_help_opens_with_what_a_worker_needs() -> None:
    short = _help("worker", "--help")
    for flag in ("--listen", "--model", "--threads"):
        assert flag in short
    assert "--kv-role" not in short and "--kv-role" in _help("worker", "--help-all")


def test_no_help_labels_a_flag_with_a_type() -> None:
    for path in _command_paths():
        out = _help(*path, "--help")
        assert not re.search(r"--help\s+<bool>", out), f"tokenmill {' '.join(path)} --help"
        assert "<bool>" not in out, f"a flag with a type label in `tokenmill {' '.join(path)} --help`"


def test_the_config_page_examples_are_trees_serve_reads() -> None:
    page = (ROOT / "docs" / "reference" / "config.md").read_text()
    blocks = re.findall(r"```yaml\n(.*?)```", page, re.S)
    assert len(blocks) == 2
    assert tree_from_mapping(ServerConfig, yaml.safe_load(blocks[0])).engine.quantization == "int4"
    assert tree_from_mapping(ServerConfig, yaml.safe_load(blocks[1])) == ServerConfig()
