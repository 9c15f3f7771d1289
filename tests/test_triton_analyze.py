"""`tokenmill analyze`: a sweep over a model that sleeps a fixed time per batch, on a real server."""

from __future__ import annotations

import asyncio
import csv
import json
import shutil
from itertools import product
from pathlib import Path

import numpy as np
import pytest
from typer.testing import CliRunner

from tokenmill.cli.main import app
from tokenmill.triton.analyze import Spec, Variant, _pruned, run, variant_config, variants
from tokenmill.triton.analyze_load import LoadSettings, encode_request
from tokenmill.triton.config import SCHEMA, load_config
from tokenmill.triton.pbtxt import decode, format_config, parse

tritonclient = pytest.importorskip("tritonclient.http", reason="tritonclient[http] is a dev dependency")

SLEEP_MS = 20
EXAMPLES = Path(__file__).resolve().parent.parent / "examples" / "model_repository"
CONFIG = f"""
name: "sleeper"
backend: "python"
max_batch_size: 8
input [ {{ name: "X" data_type: TYPE_FP32 dims: [ 1 ] }} ]
output [ {{ name: "Y" data_type: TYPE_FP32 dims: [ 1 ] }} ]
parameters {{ key: "sleep_ms" value: {{ string_value: "{SLEEP_MS}" }} }}
"""
MODEL = """
import json
import time

import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def initialize(self, args):
        params = json.loads(args["model_config"])["parameters"]
        self.sleep_s = float(params["sleep_ms"]["string_value"]) / 1e3

    def execute(self, requests):
        time.sleep(self.sleep_s)  # per batch, whatever its size: batching pays, instances run at once
        xs = [pb_utils.get_input_tensor_by_name(r, "X").as_numpy() for r in requests]
        return [pb_utils.InferenceResponse([pb_utils.Tensor("Y", x)]) for x in xs]
"""
FAST = LoadSettings(window_s=1.0, warmup_s=0.3, max_windows=3)


@pytest.fixture(scope="module")
def repo(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("repo")
    (root / "sleeper" / "1").mkdir(parents=True)
    (root / "sleeper" / "config.pbtxt").write_text(CONFIG)
    (root / "sleeper" / "1" / "model.py").write_text(MODEL)
    for name in ("pipeline", "accumulator"):  # an ensemble and a sequence model: refused
        shutil.copytree(EXAMPLES / name, root / name)
    return root


@pytest.fixture(scope="module")
def sweep(repo, tmp_path_factory):
    spec = Spec(
        repo, "sleeper", latency_limit_ms=1e9, output_dir=tmp_path_factory.mktemp("out"),
        instances=[1], max_batch=[1, 4], queue_delay_us=[0], concurrency=[1, 4], load=FAST,
    )  # fmt: skip
    return asyncio.run(run(spec))


def test_best_config_is_one_of_the_swept_and_loads(sweep, tmp_path) -> None:
    written = sweep.files["config"]
    model_dir = tmp_path / "sleeper"
    model_dir.mkdir()
    shutil.copy(written, model_dir / "config.pbtxt")
    cfg = load_config(model_dir)  # tokenmill's own loader, as the server reads it
    original = load_config(sweep.spec.repository / "sleeper")
    swept = {(v.instances, v.max_batch_size, v.queue_delay_us) for v in variants(original, sweep.spec)}
    delay = cfg.dynamic_batching["max_queue_delay_microseconds"] if cfg.dynamic_batching else None
    assert (cfg.instance_count, cfg.max_batch_size, delay) in swept
    assert (cfg.name, cfg.inputs, cfg.outputs, cfg.parameters) == (
        original.name, original.inputs, original.outputs, original.parameters,
    )  # fmt: skip
    assert f"concurrency {sweep.best.m.concurrency}" in written.read_text()


def test_remeasured_p99_meets_a_limit_nothing_misses(sweep) -> None:
    again = json.loads(sweep.files["json"].read_text())["remeasured"]
    assert again["latency_p99_ms"] > 0 and again["meets_limit"] is True
    assert again["concurrency"] == sweep.best.m.concurrency and again["errors"] == 0


def test_csv_has_a_row_per_configuration_and_concurrency(sweep) -> None:
    with sweep.files["csv"].open() as f:
        rows = list(csv.DictReader(f))
    assert sorted((r["config"], int(r["concurrency"])) for r in rows) == sorted(
        product(["i1_b1_d0", "i1_b4_d0"], [1, 4])
    )
    assert sweep.files["plot"].stat().st_size > 0


def test_measurements_agree_with_the_model_and_the_server(sweep) -> None:
    """Bounds that hold on any machine: no request is faster than the model's sleep, no configuration
    serves more than its instances x batch per sleep, batch 1 (or one client) runs batches of 1."""
    for r in sweep.rows:
        v, m = r.variant, r.m
        assert m.latency_p50_ms >= SLEEP_MS and m.latency_p99_ms >= m.latency_p50_ms
        # each instance ends at most one batch per sleep, plus one at the edge of each window merged
        seconds = m.requests / m.throughput
        assert m.requests <= v.instances * max(1, v.max_batch_size) * (seconds * 1e3 / SLEEP_MS + 3)
        assert m.server_compute_us >= SLEEP_MS * 1e3 * 0.99  # the server's own statistics
        if v.max_batch_size == 1 or m.concurrency == 1:
            assert m.avg_batch == 1.0
        assert 1.0 <= m.avg_batch <= min(m.concurrency, v.max_batch_size)


def test_a_limit_below_the_sleep_cannot_be_met(repo, tmp_path) -> None:
    out = tmp_path / "out"
    r = CliRunner().invoke(
        app,
        ["analyze", str(repo), "sleeper", "--latency-limit-ms", str(SLEEP_MS / 2), "--instances", "1",
         "--max-batch", "1", "--concurrency", "1", "--window-s", "1", "--warmup-s", "0.3",
         "--max-windows", "3", "--output-dir", str(out)],
    )  # fmt: skip
    assert r.exit_code == 1, r.output
    assert "no configuration met p99 <= 10 ms" in r.output
    with (out / "results.csv").open() as f:
        rows = list(csv.DictReader(f))
    assert len(rows) == 1 and rows[0]["meets_limit"] == "False"
    assert not (out / "best").exists()


@pytest.mark.parametrize(
    ("model", "message"),
    [
        ("nope", "model 'nope' is not in repository"),
        ("pipeline", "is an ensemble: tokenmill analyze does not support ensembles yet"),
        ("accumulator", "sequence models are not supported yet"),
    ],
)
def test_models_it_cannot_analyze_are_one_line_errors(repo, tmp_path, model: str, message: str) -> None:
    r = CliRunner().invoke(
        app, ["analyze", str(repo), model, "--latency-limit-ms", "50", "--output-dir", str(tmp_path)]
    )
    assert r.exit_code == 2 and message in r.output and "Traceback" not in r.output
    assert len(r.output.strip().splitlines()) == 1


def test_request_body_is_tritonclients() -> None:
    x = np.arange(6, dtype=np.float32).reshape(1, 6)
    s = np.array([[b"ab", b"", b"xyz"]], dtype=object)
    ours, n = encode_request({"X": x, "S": s})
    inputs = []
    for name, arr, dt in (("X", x, "FP32"), ("S", s, "BYTES")):
        inp = tritonclient.InferInput(name, list(arr.shape), dt)
        inp.set_data_from_numpy(arr, binary_data=True)
        inputs.append(inp)
    theirs, their_n = tritonclient.InferenceServerClient.generate_request_body(inputs)
    assert json.loads(ours[:n]) == json.loads(theirs[:their_n]) and ours[n:] == theirs[their_n:]


def test_written_configs_read_back_the_same() -> None:
    """format_config, checked by tokenmill's parser: the examples and the sweep's variants."""
    configs = [load_config(d) for d in sorted(EXAMPLES.iterdir())]
    raws = [c.raw for c in configs]
    for v in (Variant(2, 16, 500), Variant(1, 0, None)):
        raws += [variant_config(c, v) for c in configs if c.batched == bool(v.max_batch_size)]
    for raw in raws:
        assert decode(parse(format_config(raw, SCHEMA, "a\ncomment")), SCHEMA, "x") == raw


def test_variants_sweep_what_the_model_allows(repo, tmp_path) -> None:
    spec = Spec(repo, "x", 1.0, tmp_path, instances=[1, 2], max_batch=[1, 8], queue_delay_us=[0, 500])
    batching = load_config(repo / "sleeper")
    got = variants(batching, spec)
    assert {(v.max_batch_size, v.queue_delay_us) for v in got} == {(1, 0), (8, 0), (8, 500)}
    assert len(got) == 6
    not_batching = load_config(EXAMPLES / "sleeper")  # max_batch_size 0: instances only
    assert variants(not_batching, spec) == [Variant(1, 0, None), Variant(2, 0, None)]


def test_quick_stops_a_delay_or_batch_that_stopped_paying() -> None:
    score = {Variant(1, 4, 0): 100.0, Variant(1, 4, 100): 101.0}
    assert _pruned(Variant(1, 4, 500), score)  # +1 %: no longer delay
    assert not _pruned(Variant(1, 8, 0), score)  # one batch size measured: nothing to compare yet
    score |= {Variant(1, 8, 0): 300.0, Variant(1, 8, 100): 100.0}
    assert not _pruned(Variant(1, 16, 0), score)  # batch 8 beat batch 4
    score = {Variant(1, 1, 0): 100.0, Variant(1, 2, 0): 100.0}
    assert _pruned(Variant(1, 4, 0), score) and not _pruned(Variant(2, 4, 0), score)
