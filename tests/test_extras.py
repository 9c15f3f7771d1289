"""Lean installs: the server imports none of the extras' packages, and a command whose extra is missing
says which one to install, in one line, without a traceback.

Each case runs in a subprocess whose optional packages are blocked (sys.modules[name] = None makes their
import fail, as if they were not installed), so the test holds on a machine that has every extra.
"""

from __future__ import annotations

import json
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

from tokenmill.extras import EXTRAS, MissingExtra, missing, require

ROOT = Path(__file__).resolve().parent.parent
OPTIONAL = sorted({m for modules in EXTRAS.values() for m in modules})


def _run(code: str, blocked: list[str]) -> subprocess.CompletedProcess[str]:
    prelude = f"import sys\nfor _m in {blocked!r}:\n    sys.modules[_m] = None\n"
    return subprocess.run(
        [sys.executable, "-c", prelude + code], capture_output=True, text=True, timeout=120, cwd=ROOT
    )


def _cli(args: list[str], blocked: list[str]) -> subprocess.CompletedProcess[str]:
    code = f"sys.argv = ['tokenmill', *{args!r}]\nfrom tokenmill.cli.main import main\nmain()\n"
    return _run(code, blocked)


def test_the_server_imports_no_optional_package() -> None:
    r = _run(
        "import json, tokenmill.server.app, tokenmill.server.main, tokenmill.cli.main\n"
        f"print(json.dumps(sorted(m for m in {OPTIONAL!r} if m in sys.modules)))",
        blocked=[],
    )
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout) == []


def _one_line(r: subprocess.CompletedProcess[str], feature: str, extra: str) -> None:
    lines = [ln for ln in r.stderr.splitlines() if ln.strip()]
    assert "Traceback" not in r.stderr, r.stderr
    assert len(lines) == 1, r.stderr
    assert r.returncode == 2, r.stderr
    assert lines[0].startswith(f"error: {feature} needs the {extra} extra ("), lines[0]
    assert lines[0].endswith(f"pip install 'tokenmill[{extra}]'"), lines[0]


BENCH = ["matplotlib", "scipy"]


@pytest.mark.parametrize(
    ("command", "feature"),
    [
        ("bench --url http://127.0.0.1:9/v1", "tokenmill bench"),
        ("size --model llama3-8b --isl 2000 --osl 200 --rps 31", "tokenmill size"),
        ("size predict --model llama3-8b --isl 100 --osl 10", "tokenmill size predict"),
        ("size calibrate x.json --model llama3-8b --gpu h100-sxm", "tokenmill size calibrate"),
        ("plan simulate", "tokenmill plan simulate"),
    ],
)
def test_bench_size_and_plan_name_the_bench_extra(command: str, feature: str) -> None:
    _one_line(_cli(command.split(), BENCH), feature, "bench")


def test_help_and_compare_need_no_extra() -> None:
    for command in ("bench --help", "bench compare --help", "size --help", "size predict --help"):
        r = _cli(command.split(), BENCH)
        assert r.returncode == 0, (command, r.stderr)
        assert "Usage" in r.stdout


@pytest.fixture
def model_file(tmp_path: Path) -> Path:
    """A path the catalog takes for a GGUF model: the extras are asked for before anything loads it."""
    path = tmp_path / "model.gguf"
    path.write_bytes(b"")
    return path


@pytest.mark.parametrize(
    ("flags", "blocked", "feature", "extra"),
    [
        ("--model-repository {tmp}", "onnxruntime", "serve --model-repository", "triton"),
        ("--launcher ray", "ray", "serve --launcher ray", "ray"),
        ("--discovery k8s --discovery-target workers", "kubernetes", "serve --discovery k8s", "k8s"),
        (
            "--otlp-traces-endpoint http://127.0.0.1:9/v1/traces",
            "opentelemetry.sdk",
            "serve --otlp-traces-endpoint",
            "tracing",
        ),
    ],
)
def test_serve_names_its_missing_extra(
    flags: str, blocked: str, feature: str, extra: str, model_file: Path
) -> None:
    """Said before the engine starts: the (empty) model file is never read."""
    args = ["serve", "--model", str(model_file), "--port", "0", *flags.format(tmp=model_file.parent).split()]
    _one_line(_cli(args, [blocked]), feature, extra)


def test_require_raises_an_import_and_a_value_error() -> None:
    missing_one = MissingExtra("bench", "tokenmill bench", "matplotlib")
    assert isinstance(missing_one, ImportError) and isinstance(missing_one, ValueError)
    assert missing_one.name == "matplotlib" and missing_one.extra == "bench"
    for extra in EXTRAS:  # this environment has every extra (make test installs .[dev])
        assert missing(extra, "x") is None
        require(extra, "x")


def test_the_table_matches_pyproject() -> None:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    extras = project["optional-dependencies"]
    assert set(EXTRAS) <= set(extras)
    assert extras["all"] == [f"tokenmill[{','.join(EXTRAS)}]"]
    assert "tokenmill[all,docs]" in extras["dev"]
    base = " ".join(project["dependencies"])
    for package in ("onnxruntime", "tritonclient", "matplotlib", "scipy", "ray", "kubernetes"):
        assert package not in base, f"{package} is in the base install"
