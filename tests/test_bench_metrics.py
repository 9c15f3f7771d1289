"""Unit tests of the benchmark's metric definitions, statistics, SLOs, arrivals and search."""

from __future__ import annotations

import asyncio
import json
import random
import statistics
from dataclasses import dataclass

import pytest

from tokenmill.bench.compare import compare
from tokenmill.bench.load import LoadConfig, arrival_offsets
from tokenmill.bench.records import RequestRecord
from tokenmill.bench.runner import GoodputSearch, _search
from tokenmill.bench.stats import Slo, describe, meets_all, parse_slos, summarize
from tokenmill.bench.workload import PRESETS, PromptMaker, WorkloadConfig, sessions


def rec(index: int, send: float, chunks: list[float], osl: int | None = None, **kw) -> RequestRecord:
    end = kw.pop("end", chunks[-1] if chunks else None)
    return RequestRecord(
        index=index,
        t_send=send,
        t_end=end,
        chunk_times=chunks,
        osl=len(chunks) if osl is None else osl,
        isl=kw.pop("isl", 10),
        **kw,
    )


def test_per_request_metrics_by_definition() -> None:
    # Sent at 1.0 s; chunks at 1.2, 1.25, 1.3, 1.4 s; 5 output tokens (one chunk carried two).
    r = rec(0, 1.0, [1.2, 1.25, 1.3, 1.4], osl=5)
    assert r.metric_ms("ttft") == pytest.approx(200.0)
    assert r.metric_ms("ttst") == pytest.approx(50.0)
    assert r.metric_ms("e2e") == pytest.approx(400.0)
    assert r.metric_ms("itl") == pytest.approx((400.0 - 200.0) / 4)  # (E2E - TTFT) / (OSL - 1)
    assert r.tps_user == pytest.approx(1 / 0.05)
    assert [round(g * 1e3, 6) for g in r.chunk_gaps_s] == [50.0, 50.0, 100.0]
    one = rec(1, 0.0, [0.1], osl=1)
    assert one.itl_s is None and one.ttst_s is None and one.tps_user is None
    unstreamed = rec(2, 0.0, [], osl=7, end=0.9)
    assert unstreamed.ttft_s is None and unstreamed.metric_ms("e2e") == pytest.approx(900.0)


def test_describe_matches_hand_computed_percentiles() -> None:
    d = describe([1.0, 2.0, 3.0, 4.0, 10.0])
    assert d["mean"] == pytest.approx(4.0)
    assert d["min"] == 1.0 and d["max"] == 10.0
    assert d["std"] == pytest.approx(statistics.pstdev([1, 2, 3, 4, 10]))
    # Linear interpolation: rank p/100 * (n - 1) between sorted values.
    assert d["p50"] == pytest.approx(3.0)
    assert d["p90"] == pytest.approx(4.0 + 0.6 * (10.0 - 4.0))  # rank 3.6
    assert d["p95"] == pytest.approx(4.0 + 0.8 * 6.0)  # rank 3.8
    assert d["p99"] == pytest.approx(4.0 + 0.96 * 6.0)  # rank 3.96
    assert describe([]) is None


def test_parse_slos_and_errors() -> None:
    slos = parse_slos("ttft=500ms, itl=0.05s,e2e=2s,ttst=300,tps_user=20")
    assert slos == [
        Slo("ttft", 500.0),
        Slo("itl", 50.0),
        Slo("e2e", 2000.0),
        Slo("ttst", 300.0),
        Slo("tps_user", 20.0),
    ]
    for bad, words in [
        ("ttft", "NAME=VALUE"),
        ("foo=1ms", "unknown SLO"),
        ("ttft=fast", "not a time"),
        ("tps_user=x", "not a number"),
    ]:
        with pytest.raises(ValueError, match=words):
            parse_slos(bad)


def test_goodput_hand_computed() -> None:
    # Four requests over exactly 2 s; SLO ttft <= 300 ms and itl <= 60 ms.
    records = [
        rec(0, 0.0, [0.1, 0.15, 0.2]),  # ttft 100, itl 50: good
        rec(1, 0.5, [0.9, 0.95, 1.0]),  # ttft 400: bad
        rec(2, 1.0, [1.2, 1.3, 1.4]),  # itl 100: bad
        rec(3, 1.5, [1.6, 1.65, 2.0], osl=11),  # ttft 100, itl (500-100)/10 = 40: good
        RequestRecord(index=4, t_send=1.0, error="http_429"),  # failed: never good
        rec(5, -5.0, [-4.0], warmup=True),  # warm-up: left out entirely
    ]
    slos = parse_slos("ttft=300ms,itl=60ms")
    assert [meets_all(r, slos) for r in records[:5]] == [True, False, False, True, False]
    s = summarize(records, slos)
    assert s["duration_s"] == pytest.approx(2.0)  # last response - first send of measured requests
    assert s["completed"] == 4 and s["failed"] == 1 and s["errors"] == {"http_429": 1}
    assert s["good_requests"] == 2
    assert s["goodput"] == pytest.approx(1.0)
    assert s["slo_attainment"] == pytest.approx(2 / 5)
    assert s["request_throughput"] == pytest.approx(2.0)
    assert s["output_token_throughput"] == pytest.approx((3 + 3 + 3 + 11) / 2.0)
    assert s["input_token_throughput"] == pytest.approx(40 / 2.0)
    assert s["ttft_ms"]["max"] == pytest.approx(400.0)
    # A request without an ITL (one token) fails an ITL SLO rather than passing it.
    assert not meets_all(rec(9, 0.0, [0.01], osl=1), slos)
    assert set(json.loads(json.dumps(s))) >= {
        "ttft_ms",
        "ttst_ms",
        "itl_ms",
        "e2e_ms",
        "request_throughput",
        "output_token_throughput",
        "input_token_throughput",
        "goodput",
        "completed",
        "failed",
    }


def test_cancelled_at_end_is_neither_success_nor_failure() -> None:
    s = summarize([rec(0, 0.0, [0.1, 0.2]), RequestRecord(index=1, t_send=0.5, error="cancelled")], [])
    assert s["completed"] == 1 and s["failed"] == 0 and s["cancelled_at_end"] == 1


@pytest.mark.parametrize("rate", [2.0, 50.0])
def test_poisson_arrivals_have_the_right_rate(rate: float) -> None:
    gen = arrival_offsets(rate, "poisson", random.Random(1))
    times = [next(gen) for _ in range(20001)]
    gaps = [b - a for a, b in zip(times, times[1:], strict=False)]
    assert statistics.fmean(gaps) == pytest.approx(1 / rate, rel=0.03)
    # Exponential gaps: the standard deviation equals the mean.
    assert statistics.pstdev(gaps) == pytest.approx(1 / rate, rel=0.05)
    fixed = list(arrival_offsets(rate, "poisson", random.Random(1), n=40))
    assert len(fixed) == 40 and fixed[-1] == pytest.approx(39 / rate)  # exact rate for a known count
    const = arrival_offsets(rate, "constant", random.Random(1))
    assert [next(const) for _ in range(4)] == pytest.approx([0, 1 / rate, 2 / rate, 3 / rate])


@dataclass
class _Level:
    summary: dict


def test_goodput_search_doubles_then_bisects() -> None:
    capacity = 5.3
    tried: list[float] = []

    async def level(load: LoadConfig) -> _Level:
        tried.append(load.request_rate)
        att = 1.0 if load.request_rate <= capacity else 0.5
        return _Level({"slo_attainment": att, "goodput": min(load.request_rate, capacity)})

    out = asyncio.run(
        _search(
            level,
            LoadConfig(num_requests=10),
            GoodputSearch(0.9, start_rate=1.0, max_doublings=8, bisect_steps=4),
        )
    )
    assert tried == [1.0, 2.0, 4.0, 8.0, 6.0, 5.0, 5.5, 5.25]
    assert out["max_good_rate"] == 5.25 and out["first_failing_rate"] == 5.5
    # Starting above capacity halves first.
    tried.clear()
    out = asyncio.run(
        _search(
            level,
            LoadConfig(num_requests=10),
            GoodputSearch(0.9, start_rate=16.0, max_doublings=8, bisect_steps=0),
        )
    )
    assert tried == [16.0, 8.0, 4.0] and out["max_good_rate"] == 4.0


def test_goodput_search_rejects_rates_the_server_does_not_keep_up_with() -> None:
    # A short run above capacity can meet its SLOs before the queue has grown; the completion rate
    # falling behind the arrival rate gives it away.
    capacity = 3.7

    async def level(load: LoadConfig) -> _Level:
        r = load.request_rate
        return _Level(
            {
                "slo_attainment": 1.0,
                "goodput": min(r, capacity),
                "arrival_rate": r,
                "completion_rate": min(r, capacity),
            }
        )

    out = asyncio.run(_search(level, LoadConfig(num_requests=10), GoodputSearch(0.9, start_rate=1.0)))
    assert 3.7 <= out["max_good_rate"] <= 3.7 / 0.9
    assert not out["probes"][-1]["keeps_up"] or out["probes"][-1]["request_rate"] == out["max_good_rate"]


def test_arrival_and_completion_rates() -> None:
    # Sent every 0.1 s, but completed every 0.2 s: the server falls behind.
    records = [rec(i, 0.1 * i, [0.2 * i + 0.05, 0.2 * i + 0.1]) for i in range(11)]
    s = summarize(records, [])
    assert s["arrival_rate"] == pytest.approx(10.0) and s["completion_rate"] == pytest.approx(5.0)


class WordCounter:
    """A stand-in tokenizer: one token per word."""

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return [hash(w) % 1000 for w in text.split()]

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return " ".join(f"w{i}" for i in ids)


def test_prompts_have_exact_token_counts_with_the_real_tokenizer(model_path) -> None:
    from tokenmill.weights.tokenizer_source import load_tokenizer

    tok = load_tokenizer(model_path, None)
    maker = PromptMaker(tok, random.Random(0))
    for n in (1, 7, 64, 500):
        text, count = maker.make(n)
        assert count == n == len(tok.encode(text, add_special_tokens=False))
    # Different requests do not share a start (no accidental prefix-cache hits).
    starts = {maker.make(32)[0][:40] for _ in range(50)}
    assert len(starts) == 50


def test_workload_shapes() -> None:
    cfg = WorkloadConfig(isl=40, isl_std=10, osl=20, osl_std=5, seed=3)
    got = [next(s) for s in [sessions(cfg, WordCounter())] for _ in range(400)]
    assert statistics.fmean(t.turns[0].prompt_tokens for t in got) == pytest.approx(40, rel=0.05)
    assert statistics.pstdev(t.turns[0].max_tokens for t in got) == pytest.approx(5, rel=0.15)
    pre = sessions(WorkloadConfig(isl=10, prefix_groups=3, prefix_tokens=30), WordCounter())
    systems = [next(pre).system for _ in range(9)]
    assert len(set(systems)) == 3 and all(len(s.split()) == 30 for s in systems)
    multi = next(sessions(WorkloadConfig(isl=10, osl=5, turns=4), WordCounter()))
    assert len(multi.turns) == 4
    rag = next(sessions(WorkloadConfig(preset="rag"), WordCounter()))
    assert rag.turns[0].prompt_tokens > 500
    assert set(PRESETS) == {"chatbot", "rag", "summarization", "translation", "generation", "reasoning"}
    with pytest.raises(ValueError, match="unknown preset"):
        next(sessions(WorkloadConfig(preset="poetry"), None))


def test_jsonl_input_file(tmp_path) -> None:
    f = tmp_path / "p.jsonl"
    f.write_text(
        '{"prompt": "hello there", "max_tokens": 3}\n\n{"messages": [{"role": "user", "content": "hi"}]}\n'
    )
    s = sessions(WorkloadConfig(input_file=str(f), osl=9), None)
    a, b, c = next(s), next(s), next(s)
    assert a.turns[0].text == "hello there" and a.turns[0].max_tokens == 3
    assert b.messages == [{"role": "user", "content": "hi"}] and b.turns[0].max_tokens == 9
    assert c.turns[0].text == "hello there"  # the file repeats
    f.write_text('{"prompt": "ok"}\nnot json\n')
    with pytest.raises(ValueError, match=r"p.jsonl:2: not JSON"):
        next(sessions(WorkloadConfig(input_file=str(f)), None))


def test_compare_ratios(tmp_path) -> None:
    a = {
        "label": "concurrency1",
        "ttft_ms": {"mean": 100.0, "p50": 90.0, "p90": 150.0, "p99": 200.0},
        "output_token_throughput": 50.0,
        "request_throughput": 1.0,
        "completed": 10,
        "failed": 0,
    }
    b = {
        **a,
        "ttft_ms": {"mean": 50.0, "p50": 45.0, "p90": 75.0, "p99": 100.0},
        "output_token_throughput": 150.0,
    }
    (tmp_path / "a.json").write_text(json.dumps(a))
    (tmp_path / "b.json").write_text(json.dumps({"runs": [b]}))
    out = compare(tmp_path / "a.json", tmp_path / "b.json")
    rows = {r["metric"]: r for r in out["levels"][0]["rows"]}
    assert rows["ttft_ms p99"]["ratio_b_over_a"] == pytest.approx(0.5)
    assert rows["output_token_throughput"]["ratio_b_over_a"] == pytest.approx(3.0)
    (tmp_path / "d.json").write_text(json.dumps({"runs": [{**b, "label": "rate2"}, {**b, "label": "rate4"}]}))
    with pytest.raises(ValueError, match="no load level in common"):
        compare(tmp_path / "b.json", tmp_path / "d.json")
    (tmp_path / "c.json").write_text("{}")
    with pytest.raises(ValueError, match="not a tokenmill bench summary"):
        compare(tmp_path / "a.json", tmp_path / "c.json")
