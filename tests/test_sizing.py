"""`tokenmill size`: the source documents' worked examples, the Poisson peaks, calibration."""

from __future__ import annotations

import json
import random
from dataclasses import replace

import pytest
from typer.testing import CliRunner

from tokenmill.cli.main import app
from tokenmill.sizing.arch import CATALOG as MODELS
from tokenmill.sizing.arch import from_gguf, resolve
from tokenmill.sizing.calibrate import Measurement, fit, measurements_from_summary
from tokenmill.sizing.hardware import CATALOG as GPUS
from tokenmill.sizing.hardware import Factors, default_factors
from tokenmill.sizing.roofline import Deployment, predict
from tokenmill.sizing.search import Limits, frontier, peak_rps, size, words_to_tokens

H100 = GPUS["h100-sxm"]


def within(value: float, target: float, rel: float) -> bool:
    return abs(value / target - 1) <= rel


def test_parameter_counts_from_shapes() -> None:
    assert MODELS["llama3-8b"].params_total == pytest.approx(8.03e9, rel=2e-3)
    assert MODELS["llama3-70b"].params_total == pytest.approx(70.55e9, rel=2e-3)
    mix = MODELS["mixtral-8x7b"]
    assert mix.params_total == pytest.approx(46.7e9, rel=5e-3) and mix.params_active == pytest.approx(
        12.9e9, rel=5e-3
    )
    assert MODELS["gpt-43b"].params_total == pytest.approx(42.8e9, rel=3e-3)
    # KV per token (16-bit): Llama-3-8B 128 KiB, 70B 320 KiB, the 43B MHA GPT 1.5 MiB.
    assert MODELS["llama3-8b"].kv_bytes_per_token(2) == 128 * 1024
    assert MODELS["llama3-70b"].kv_bytes_per_token(2) == 320 * 1024
    assert MODELS["gpt-43b"].kv_bytes_per_token(2) == 1.5 * 2**20


def test_models_from_config_json_and_gguf(tmp_path, model_path) -> None:
    cfg = {
        "hidden_size": 4096,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "num_hidden_layers": 32,
        "intermediate_size": 14336,
        "vocab_size": 32000,
        "num_local_experts": 8,
        "num_experts_per_tok": 2,
    }
    (tmp_path / "mixtral").mkdir()
    (tmp_path / "mixtral" / "config.json").write_text(json.dumps(cfg))
    a = resolve(str(tmp_path / "mixtral"))
    assert a.name == "mixtral" and a.params_total == MODELS["mixtral-8x7b"].params_total
    g = from_gguf(model_path)
    assert g.params_total == MODELS["smollm2-135m"].params_total and g.tied
    with pytest.raises(ValueError, match="not in the sizing catalog"):
        resolve("gpt-5")


def test_poisson_peaks_of_the_documents() -> None:
    assert peak_rps(64, 95) == 77
    assert peak_rps(7, 95) == 12
    assert peak_rps(200, 95) == 224
    assert words_to_tokens(3500 * 0.75) == 3500


def test_seed_a_43b_on_dgx_h100() -> None:
    """43B, 3500 in / 500 out, TTFT <= 3 s, 31 req/s on DGX H100: 13 servers (12-14), TTFT, ITL and
    per-server throughput within 20% of 2606 ms, 21.4 ms and 2.4 req/s."""
    r = size(
        MODELS["gpt-43b"],
        H100,
        "fp16",
        default_factors("h100-sxm", "fp16"),
        3500,
        500,
        Limits(ttft_s=3.0),
        31,
    )
    assert 12 <= r.servers <= 14
    p = r.best.prediction
    assert within(p.ttft_s, 2.606, 0.20), p.ttft_s
    assert within(p.itl_s, 0.0214, 0.20), p.itl_s
    assert within(r.best.rps_per_server, 2.4, 0.20), r.best.rps_per_server
    assert p.ttft_s <= 3.0


def test_seed_b_llama3_8b_fp8() -> None:
    """Llama 3 8B FP8, 2000 in / 200 out, TTFT < 500 ms: about 70.7 requests/s per DGX H100."""
    r = size(
        MODELS["llama3-8b"],
        H100,
        "fp8",
        default_factors("h100-sxm", "fp8"),
        2000,
        200,
        Limits(ttft_s=0.5),
        70,
    )
    assert within(r.best.rps_per_server, 70.7, 0.20), r.best.rps_per_server
    assert r.best.prediction.ttft_s < 0.5


def test_seed_e_llama_70b_tp4_batch8() -> None:
    """Llama 70B FP16, TP4, batch 8, 3500 tokens in: prefill ~2.6 s and ~26.8 ms per output token."""
    d = Deployment(MODELS["llama2-70b"], H100, "fp16", default_factors("h100-sxm", "fp16"), tp=4)
    assert within(d.prefill_s(8, 3500), 2.6, 0.25), d.prefill_s(8, 3500)
    assert within(d.decode_step_s(8, 3500), 0.0268, 0.25), d.decode_step_s(8, 3500)


def test_model_behaves_like_a_roofline() -> None:
    f = default_factors("h100-sxm", "fp16")
    d = Deployment(MODELS["llama3-8b"], H100, "fp16", f)
    # Decode at batch 1 is bound by reading the weights: ~16 GB / (3.35 TB/s x MBU) + overhead.
    assert d.decode_step_s(1, 100) == pytest.approx(
        16.06e9 / 3.35e12 / f.mbu_weights + 32 * f.overhead_per_layer_s, rel=0.02
    )
    # More sequences cost more KV reads; FP8 halves the bytes; TP splits them (plus all-reduces).
    assert d.decode_step_s(64, 2000) > d.decode_step_s(1, 2000)
    assert replace(d, precision="fp8").decode_step_s(8, 2000) < d.decode_step_s(8, 2000)
    assert replace(d, tp=2).decode_step_s(8, 2000) < d.decode_step_s(8, 2000)
    # Prefill is compute bound: 4x the tokens take about 4x the time.
    assert d.prefill_s(4, 2000) / d.prefill_s(1, 2000) == pytest.approx(4, rel=0.1)
    # Memory: 70B in FP16 does not fit one H100; it does at TP2.
    big = Deployment(MODELS["llama3-70b"], H100, "fp16", f)
    assert not big.fits(1, 1000) and replace(big, tp=2).fits(1, 1000)
    # A MoE step reads only the experts its tokens use.
    mix = Deployment(MODELS["mixtral-8x7b"], H100, "fp16", f, tp=2)
    assert mix._weight_bytes(1) < 0.4 * mix._weight_bytes(256)
    # Expert parallelism: the busiest rank's touched experts. One token's two experts of 8 on 2 ranks share
    # a rank 3 times in 7 (exactly: 12 of the 28 pairs); the model's independent-experts estimate is close.
    ep = replace(mix, ep=True)
    experts = mix.arch.layers * mix.arch.expert_params * mix.b_w
    extra = (ep._weight_bytes(1) - mix._weight_bytes(1)) / experts  # experts read beyond TP's 2
    assert extra == pytest.approx(2 * (1 + 3 / 7) - 2, abs=0.1)
    assert ep._weight_bytes(256) == pytest.approx(mix._weight_bytes(256), rel=1e-3)
    assert ep.decode_step_s(1, 1000) > mix.decode_step_s(1, 1000)


def test_an_8bit_kv_cache_halves_the_kv_bytes() -> None:
    """`--kv-cache-dtype int8|fp8` at 16-bit weights: one byte a KV element, so half the KV memory, about
    twice the sequences in what the weights leave, and faster long-context decode steps."""
    f = default_factors("h100-sxm", "bf16")
    d = Deployment(MODELS["llama3-8b"], H100, "bf16", f)
    q = replace(d, kv_cache_dtype="int8")
    assert q.b_w == d.b_w and q.b_kv == d.b_kv / 2
    assert q.kv_gb_per_gpu(64, 4000) == pytest.approx(d.kv_gb_per_gpu(64, 4000) / 2)
    assert q.max_seqs(4000) == pytest.approx(2 * d.max_seqs(4000), rel=0.01)
    assert q.decode_step_s(64, 4000) < d.decode_step_s(64, 4000)
    assert replace(d, kv_cache_dtype="auto").b_kv == d.b_kv  # auto: the precision's own
    assert replace(d, precision="fp8", kv_cache_dtype="bf16").b_kv == 2.0  # and it can widen too


def test_limits_and_frontier() -> None:
    f = default_factors("h100-sxm", "fp16")
    tight = size(MODELS["llama3-70b"], H100, "fp16", f, 2000, 200, Limits(ttft_s=0.01), 10)
    assert tight.best is None and "no shape meets" in tight.notes[0]
    loose = size(MODELS["llama3-8b"], H100, "fp16", f, 500, 100, Limits(itl_s=0.02), 10)
    assert all(c.prediction.itl_s <= 0.02 for c in loose.feasible)
    seq = size(MODELS["llama3-8b"], H100, "fp16", f, 500, 100, Limits(e2e_s=1.0, mode="sequential"), 10)
    assert all(c.prediction.e2e_s <= 1.0 for c in seq.feasible)
    assert frontier([(1, 5), (2, 4), (1.5, 3), (3, 1)]) == [(3, 1), (2, 4), (1, 5)]


def synthetic(d: Deployment, shapes, concurrencies, noise: float, rng: random.Random) -> list[Measurement]:
    out = []
    for isl, osl in shapes:
        for c in concurrencies:
            p = predict(d, c, isl, osl)
            j = lambda v: v * (1 + rng.uniform(-noise, noise))  # noqa: E731
            out.append(Measurement(c, isl, osl, j(p.ttft_s), j(p.itl_s), j(p.rps), f"c{c}"))
    return out


def test_calibration_recovers_known_factors() -> None:
    truth = Factors(mfu=0.45, mbu_weights=0.7, mbu_kv=0.5, overhead_per_layer_s=60e-6, client_s=4e-3)
    rng = random.Random(0)
    # Two models, so that the weight bandwidth and the per-layer overhead can be told apart.
    small = Deployment(MODELS["llama3-8b"], H100, "fp16", truth)
    large = Deployment(MODELS["llama3-70b"], H100, "fp16", truth, tp=4)
    data = [
        (small, synthetic(small, [(2000, 200), (500, 500)], [1, 2, 5, 10, 25, 50], 0.0, rng)),
        (large, synthetic(large, [(2000, 200), (500, 500)], [1, 2, 5, 10, 25], 0.0, rng)),
    ]
    start = default_factors("h100-sxm", "fp16")
    got = fit(data, start)
    for name in ("mfu", "mbu_weights", "mbu_kv", "overhead_per_layer_s", "client_s"):
        assert getattr(got.factors, name) == pytest.approx(getattr(truth, name), rel=0.05), name
    assert got.errors["itl"]["max"] < 1e-3
    # With 3% noise the predictions still fit within a few percent.
    noisy = [(small, synthetic(small, [(2000, 200)], [1, 2, 5, 10, 25, 50], 0.03, rng))]
    g2 = fit(noisy, start)
    assert g2.errors["rps"]["median"] < 0.05 and g2.errors["itl"]["median"] < 0.05


def test_calibrate_cli_reads_bench_summaries(tmp_path) -> None:
    truth = Factors(mfu=0.3, mbu_weights=0.5, mbu_kv=0.4, overhead_per_layer_s=200e-6, client_s=10e-3)
    d = Deployment(MODELS["smollm2-135m"], GPUS["cpu-2c"], "bf16", truth)
    runs = []
    for c in (1, 2, 4, 8):
        p = predict(d, c, 160, 64)
        runs.append(
            {
                "label": f"concurrency{c}",
                "concurrency": c,
                "isl": {"mean": 160},
                "osl": {"mean": 64},
                "ttft_ms": {"mean": p.ttft_s * 1e3},
                "itl_ms": {"mean": p.itl_s * 1e3},
                "e2e_ms": {"mean": p.e2e_s * 1e3},
                "request_throughput": p.rps,
            }
        )
    (tmp_path / "summary.json").write_text(json.dumps({"runs": runs}))
    assert len(measurements_from_summary(tmp_path / "summary.json")) == 4
    out = tmp_path / "factors.json"
    res = CliRunner().invoke(
        app,
        [
            "size",
            "calibrate",
            str(tmp_path / "summary.json"),
            "--model",
            "smollm2-135m",
            "--gpu",
            "cpu-2c",
            "--output",
            str(out),
        ],
    )
    assert res.exit_code == 0, res.output
    assert "fit error" in res.output
    res = CliRunner().invoke(
        app,
        [
            "size",
            "predict",
            "--model",
            "smollm2-135m",
            "--gpu",
            "cpu-2c",
            "--precision",
            "bf16",
            "--concurrency",
            "16",
            "--isl",
            "160",
            "--osl",
            "64",
            "--factors",
            str(out),
            "--json",
        ],
    )
    assert res.exit_code == 0, res.output
    pred = json.loads(res.output)
    truth16 = predict(d, 16, 160, 64)
    assert pred["itl_ms"] == pytest.approx(truth16.itl_s * 1e3, rel=0.05)
    assert pred["rps"] == pytest.approx(truth16.rps, rel=0.05)


def test_size_cli_json_and_plot(tmp_path) -> None:
    res = CliRunner().invoke(
        app,
        [
            "size",
            "--model",
            "llama3-8b",
            "--gpu",
            "h100-sxm",
            "--precision",
            "fp8",
            "--isl",
            "2000",
            "--osl",
            "200",
            "--ttft-ms",
            "500",
            "--avg-rps",
            "64",
            "--json",
            "--plot",
            str(tmp_path / "f.png"),
        ],
    )
    assert res.exit_code == 0, res.output
    s = json.loads(res.output)
    assert s["peak_rps"] == 77 and s["servers"] == 2 and s["gpus"] == 16
    assert s["chosen"]["ttft_ms"] < 500
    assert s["requests_per_day"] == pytest.approx(64 * 86400)
    assert s["cost_per_million_output_tokens_usd"] > 0 and s["energy_per_output_token_j"] > 0
    assert (tmp_path / "f.png").stat().st_size > 10_000
    words = CliRunner().invoke(
        app, ["size", "--model", "llama3-8b", "--isl-words", "1500", "--osl", "200", "--rps", "10", "--json"]
    )
    assert json.loads(words.output)["inputs"]["isl"] == 2000
    # A KV-heavy use case (long prompts at bf16) needs fewer servers with an 8-bit cache.
    long = ["size", "--model", "llama3-8b", "--precision", "bf16", "--isl", "8000", "--osl", "500"]
    long += ["--rps", "20", "--json"]
    plain = json.loads(CliRunner().invoke(app, long).output)
    eight = json.loads(CliRunner().invoke(app, [*long, "--kv-cache-dtype", "int8"]).output)
    assert eight["inputs"]["kv_cache_dtype"] == "int8" and plain["inputs"]["kv_cache_dtype"] == "auto"
    # (the model's own figures: 2 servers at 50 sequences an instance, 1 at 100)
    assert eight["servers"] < plain["servers"]
    assert eight["chosen"]["concurrency_per_instance"] > plain["chosen"]["concurrency_per_instance"]


@pytest.mark.parametrize(
    ("args", "message"),
    [
        ([], "--model is required"),
        (["--model", "gpt-5", "--isl", "1", "--osl", "1", "--rps", "1"], "not in the sizing catalog"),
        (
            ["--model", "llama3-8b", "--gpu", "tpu", "--isl", "1", "--osl", "1", "--rps", "1"],
            "not in the catalog",
        ),
        (
            ["--model", "llama3-8b", "--precision", "fp4", "--isl", "1", "--osl", "1", "--rps", "1"],
            "--precision",
        ),
        (["--model", "llama3-8b", "--osl", "1", "--rps", "1"], "--isl (tokens) or --isl-words"),
        (
            ["--model", "llama3-8b", "--kv-cache-dtype", "int4", "--isl", "1", "--osl", "1", "--rps", "1"],
            "--kv-cache-dtype",
        ),
        (["--model", "llama3-8b", "--isl", "1", "--osl", "1"], "--rps (peak) or --avg-rps"),
        (
            [
                "--model",
                "llama3-8b",
                "--isl",
                "1",
                "--osl",
                "1",
                "--avg-rps",
                "5",
                "--peak-percentile",
                "100",
            ],
            "percentile",
        ),
        (
            ["predict", "--model", "llama3-8b", "--tp", "16", "--isl", "1", "--osl", "1"],
            "more than the 8 GPUs",
        ),
        (["calibrate", "/nope.json", "--model", "smollm2-135m", "--gpu", "cpu-2c"], "cannot read"),
    ],
)
def test_bad_input_is_a_one_line_error(args, message) -> None:
    res = CliRunner().invoke(app, ["size", *args])
    assert res.exit_code == 2 and message in res.output, res.output
    assert "Traceback" not in res.output


def test_predict_takes_the_kv_cache_dtype_too() -> None:
    args = ["size", "predict", "--model", "llama3-8b", "--precision", "bf16", "--concurrency", "32"]
    args += ["--isl", "4000", "--osl", "200", "--json"]
    plain = json.loads(CliRunner().invoke(app, args).output)
    eight = json.loads(CliRunner().invoke(app, [*args, "--kv-cache-dtype", "int8"]).output)
    assert eight["kv_cache_dtype"] == "int8" and plain["kv_cache_dtype"] == "auto"
    kv = Deployment(MODELS["llama3-8b"], H100, "bf16", default_factors("h100-sxm", "bf16")).kv_gb_per_gpu(
        32, 4200
    )
    assert plain["memory_gb_per_gpu"] - eight["memory_gb_per_gpu"] == pytest.approx(kv / 2)
    assert eight["itl_ms"] < plain["itl_ms"]
