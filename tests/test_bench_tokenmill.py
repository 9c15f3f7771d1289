"""`tokenmill bench` against the real tokenmill server on the embedded model."""

from __future__ import annotations

import json

from server_fixture import running_server
from typer.testing import CliRunner

from tokenmill.cli.main import app


def test_bench_against_tokenmill(tmp_path) -> None:
    with running_server("--max-num-seqs", "8") as proc:
        out = tmp_path / "completions"
        res = CliRunner().invoke(
            app,
            [
                "bench",
                "--url",
                f"{proc.base_url}/v1",
                "--endpoint",
                "completions",
                "--concurrency",
                "4",
                "--num-requests",
                "8",
                "--warmup-requests",
                "2",
                "--isl",
                "64",
                "--osl",
                "16",
                "--slo",
                "ttft=60s",
                "--output",
                str(out),
            ],
        )
        assert res.exit_code == 0, res.output
        chat = tmp_path / "chat"
        res2 = CliRunner().invoke(
            app,
            [
                "bench",
                "--url",
                proc.base_url,
                "--concurrency",
                "2",
                "--num-requests",
                "4",
                "--turns",
                "2",
                "--isl",
                "32",
                "--osl",
                "8",
                "--output",
                str(chat),
            ],
        )
        assert res2.exit_code == 0, res2.output
    s = json.loads((out / "summary.json").read_text())
    assert s["config"]["model"] == "smollm2-135m"  # discovered from /v1/models
    assert s["config"]["tokenizer"].startswith("smollm2-135m")  # exact counts with the model's tokenizer
    assert s["completed"] == 8 and s["failed"] == 0
    # Prompts are exactly 64 tokens as the server counts them too; outputs exactly 16 (ignore_eos).
    assert s["isl"]["min"] == s["isl"]["max"] == 64
    assert s["osl"]["min"] == s["osl"]["max"] == 16 and s["osl_sources"] == {"usage": 8}
    assert 0 < s["ttft_ms"]["p50"] < s["e2e_ms"]["p50"]
    assert s["itl_ms"]["mean"] > 0 and s["ttst_ms"]["mean"] > 0
    assert s["output_token_throughput"] > 0 and s["goodput"] == s["request_throughput"]
    c = json.loads((chat / "summary.json").read_text())
    assert c["completed"] == 4
    records = json.loads((chat / "run.json").read_text())["records"]
    first, second = sorted(
        (r for r in records if r["conversation"] == records[0]["conversation"]), key=lambda r: r["turn"]
    )
    # The second turn resends the first question and answer: chat template + 32 + 8 + 32 tokens at least.
    assert second["isl"] >= first["isl"] + 32 + 8
