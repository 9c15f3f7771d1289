"""A failure inside the engine ends the requests it concerns, with an error, and the engine goes on."""

from __future__ import annotations

import pytest

from tokenmill import LLM, SamplingParams
from tokenmill.engine.request import EngineRequest

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def llm() -> LLM:
    # float32: outputs compared across batch compositions must not hang on bf16 near-ties.
    return LLM(dtype="float32", max_model_len=256, kv_cache_memory_gb=0.05)


def run(llm: LLM, reqs: list[EngineRequest]) -> dict[str, tuple[list[int], str | None]]:
    for r in reqs:
        llm.engine.add_request(r)
    got: dict[str, tuple[list[int], str | None]] = {r.request_id: ([], None) for r in reqs}
    while llm.engine.has_unfinished():
        for o in llm.engine.step():
            toks, _ = got[o.request_id]
            got[o.request_id] = (toks + o.new_token_ids, o.finish_reason.value if o.finish_reason else None)
    return got


def req(rid: str, prompt: list[int], n: int = 6) -> EngineRequest:
    return EngineRequest(rid, prompt, SamplingParams(temperature=0, max_tokens=n, ignore_eos=True))


def test_a_sampling_failure_fails_that_request_only(llm: LLM, monkeypatch) -> None:
    alone = run(llm, [req("a0", [1, 2, 3, 4, 5])])["a0"]
    sampler = llm.engine.runner.sampler
    real = sampler._sample

    def flaky(logits, reqs, *args):
        if any(r.request_id == "bad" for r in reqs):
            raise RuntimeError("boom")
        return real(logits, reqs, *args)

    monkeypatch.setattr(sampler, "_sample", flaky)
    got = run(llm, [req("a", [1, 2, 3, 4, 5]), req("bad", [7, 8, 9]), req("c", [10, 11, 12, 13])])
    assert got["bad"] == ([], "error")
    assert got["a"] == alone, "the batch neighbour produced what it produces alone"
    assert got["c"][1] == "length" and len(got["c"][0]) == 6
    pool = llm.engine.kv.pool
    assert pool.num_free == pool.num_blocks, "the failed request's blocks are back"


def test_a_failed_step_fails_its_requests_and_the_engine_goes_on(llm: LLM, monkeypatch) -> None:
    before = run(llm, [req("x0", list(range(40, 80)))])["x0"]
    runner = llm.engine.runner
    real = runner.execute
    calls = {"n": 0}

    def broken_once(out):
        calls["n"] += 1
        if calls["n"] == 2:
            raise RuntimeError("a kernel fell over")
        return real(out)

    monkeypatch.setattr(runner, "execute", broken_once)
    got = run(llm, [req("x", list(range(40, 80))), req("y", list(range(90, 120)))])
    assert got["x"][1] == "error" and got["y"][1] == "error"
    # The prefix cache was dropped (a half-written block must never be served); later requests are
    # computed afresh and come out as before.
    again = run(llm, [req("z", list(range(40, 80)))])["z"]
    assert again == before
