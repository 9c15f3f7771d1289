"""Flags generated from the config dataclasses, and the tree built from flags and a YAML file."""

from __future__ import annotations

import dataclasses
import typing
from pathlib import Path

import pytest
import typer
from typer.testing import CliRunner

from tokenmill.cli.config_options import SERVER_SECTIONS, config_command, tree_from_mapping
from tokenmill.cli.main import app as tokenmill_app
from tokenmill.server.config import ServerConfig


def capture() -> tuple[typer.Typer, list[ServerConfig]]:
    got: list[ServerConfig] = []
    app = typer.Typer()
    config_command(app, "serve", ServerConfig, SERVER_SECTIONS, lambda c: got.append(c), help="test")

    @app.command("other")  # a second command, so that `serve` stays a sub-command
    def other() -> None: ...

    return app, got


def test_every_setting_of_every_section_is_a_flag() -> None:
    out = CliRunner().invoke(tokenmill_app, ["serve", "--help-all"], env={"COLUMNS": "200"}).output
    for sec in SERVER_SECTIONS:
        assert sec.title in out
        hints = typing.get_type_hints(sec.cls)
        for f in dataclasses.fields(sec.cls):
            if not dataclasses.is_dataclass(hints[f.name]):
                assert f"--{(f.metadata.get('flag') or f.name).replace('_', '-')}" in out, f.name


def test_flags_land_in_the_tree() -> None:
    app, got = capture()
    args = ["serve", "--port", "9", "--block-size", "8", "--no-enable-prefix-caching", "--threads", "3"]
    args += ["--tensor-parallel-size", "2", "--policy", "priority", "--load-model", "a", "--load-model", "b"]
    r = CliRunner().invoke(app, args)
    assert r.exit_code == 0, r.output
    (c,) = got
    assert (c.port, c.load_models) == (9, ["a", "b"])
    assert (c.engine.cache.block_size, c.engine.cache.enable_prefix_caching) == (8, False)
    assert (c.engine.num_threads, c.engine.parallel.tensor_parallel_size, c.engine.scheduler.policy) == (
        3,
        2,
        "priority",
    )
    assert c.engine.scheduler.max_num_seqs == 256  # untouched: the dataclass default


def test_a_yaml_file_gives_the_tree_and_flags_win(tmp_path: Path) -> None:
    f = tmp_path / "serve.yaml"
    f.write_text(
        "port: 9100\nengine:\n  dtype: float32\n  cache: {block_size: 32}\n  scheduler: {max_num_seqs: 7}\n"
    )
    app, got = capture()
    r = CliRunner().invoke(app, ["serve", "--config", str(f), "--max-num-seqs", "9"])
    assert r.exit_code == 0, r.output
    (c,) = got
    assert (c.port, c.engine.dtype, c.engine.cache.block_size) == (9100, "float32", 32)
    assert c.engine.scheduler.max_num_seqs == 9, "the flag given beats the file"


def test_a_bad_file_gets_one_line_naming_the_setting(tmp_path: Path) -> None:
    f = tmp_path / "serve.yaml"
    f.write_text("engine:\n  cache: {blok_size: 32}\n")
    app, _ = capture()
    r = CliRunner().invoke(app, ["serve", "--config", str(f)])
    assert r.exit_code == 2 and "engine.cache.blok_size" in r.output and "Traceback" not in r.output
    with pytest.raises(ValueError, match="must be a mapping"):
        tree_from_mapping(ServerConfig, {"engine": [1]})
