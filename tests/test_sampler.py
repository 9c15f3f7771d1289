"""Unit tests of the sampler on hand-made logits (no model)."""

from __future__ import annotations

import math

import pytest
import torch

from tokenmill.sampling_params import SamplingParams
from tokenmill.worker import sampler as sampler_module
from tokenmill.worker.request_state import CachedRequestState as Request
from tokenmill.worker.step import NewRequestData


class Sampler(sampler_module.Sampler):
    """The real sampler, with one token per request as these tests expect when nothing is drafted
    (the result holds each request's list of tokens: accepted drafts, then its own)."""

    def __call__(self, logits, reqs, drafts=None, bitmask=None):  # noqa: ANN001, ANN204
        res = super().__call__(logits, reqs, drafts, bitmask)
        res.token_ids = [t[0] if t else -1 for t in res.token_ids]
        res.logprobs = [lp[0] if lp else None for lp in res.logprobs]
        return res


P3 = [0.5, 0.3, 0.2]  # a known 3-token distribution


def make_req(
    rid: str = "r",
    prompt: tuple[int, ...] = (0,),
    output: tuple[int, ...] = (),
    eos: tuple[int, ...] = (),
    **params,
) -> Request:
    """A request with the given sampling params, prompt and already generated tokens."""
    p = SamplingParams(**params)
    return Request(NewRequestData(rid, list(prompt), list(output), p, list(eos), [], 0))


def greedy(**params) -> Request:
    return make_req(temperature=0.0, **params)


def rows(*values) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.float32)


def log_p(p: list[float]) -> list[float]:
    return [math.log(x) for x in p]


def test_greedy_picks_argmax():
    logits = rows([0.1, 2.0, -1.0, 1.9], [3.0, 0.0, 0.0, 0.0], [-5.0, -4.0, -3.0, -3.5])
    out = Sampler()(logits, [greedy(), greedy(), greedy()])
    assert out.token_ids == [1, 0, 2]
    assert out.logprobs == [None, None, None]


def test_greedy_rows_in_a_mixed_batch():
    logits = rows([0.0, 0.0, 9.0], log_p(P3), [1.0, 5.0, 2.0])
    out = Sampler()(logits, [greedy(), make_req(), greedy()])
    assert out.token_ids[0] == 2 and out.token_ids[2] == 1
    assert out.token_ids[1] in (0, 1, 2)


def test_bfloat16_logits_are_accepted():
    out = Sampler()(rows([0.0, 3.0, 1.0]).to(torch.bfloat16), [greedy()])
    assert out.token_ids == [1]


def test_logit_bias_forces_a_token():
    logits = rows([5.0, 0.0, 0.0], [5.0, 4.0, 0.0])
    reqs = [greedy(logit_bias={2: 10.0, 99: 50.0}), greedy(logit_bias={0: -100.0})]  # 99: outside the vocab
    # Row 0: [5, 0, 10] -> 2. Row 1: [-95, 4, 0] -> 1.
    assert Sampler()(logits, reqs).token_ids == [2, 1]


def test_logit_bias_applies_before_random_sampling():
    # A bias of -inf-like size removes tokens 0 and 1 from the draw.
    reqs = [make_req(seed=s, logit_bias={0: -1e4, 1: -1e4}) for s in range(20)]
    logits = rows(*[log_p(P3)] * 20)
    assert Sampler()(logits, reqs).token_ids == [2] * 20


def test_min_tokens_masks_eos_and_stop_tokens():
    logits = rows([0.0, 1.0, 9.0, 8.0])  # EOS (2) is the argmax, stop token 3 next
    s = Sampler()
    # 0 of 2 minimum tokens generated: EOS and the stop token are masked -> 1.
    assert s(logits, [greedy(eos=(2,), stop_token_ids=[3], min_tokens=2)]).token_ids == [1]
    # 1 of 2 generated: still masked.
    assert s(logits, [greedy(eos=(2,), stop_token_ids=[3], min_tokens=2, output=(1,))]).token_ids == [1]
    # 2 of 2 generated: EOS may come.
    assert s(logits, [greedy(eos=(2,), stop_token_ids=[3], min_tokens=2, output=(1, 1))]).token_ids == [2]
    # Without min_tokens EOS wins at once.
    assert s(logits, [greedy(eos=(2,))]).token_ids == [2]


def test_min_tokens_with_ignore_eos_leaves_eos_alone():
    logits = rows([0.0, 1.0, 9.0, 8.0])
    req = greedy(eos=(2,), stop_token_ids=[3], min_tokens=2, ignore_eos=True)
    assert Sampler()(logits, [req]).token_ids == [2]  # EOS does not stop it, so it is not masked


def test_repetition_penalty_hf_semantics():
    logits = rows([2.0, -1.0, 3.0, 0.5, -2.0])
    req = greedy(prompt=(0,), output=(1,), repetition_penalty=2.0)
    out = Sampler._apply_penalties(logits, [req])
    # Seen tokens 0 (prompt) and 1 (output): 2.0 / 2 = 1.0, -1.0 * 2 = -2.0; others unchanged.
    assert out.tolist() == [[1.0, -2.0, 3.0, 0.5, -2.0]]
    assert logits.tolist() == [[2.0, -1.0, 3.0, 0.5, -2.0]]  # the input is not modified


def test_repetition_penalty_changes_the_choice():
    s = Sampler()
    # Positive logit of a prompt token: 3.0 / 2 = 1.5 < 2.5 -> token 1.
    assert s(rows([3.0, 2.5]), [greedy(prompt=(0,), repetition_penalty=2.0)]).token_ids == [1]
    # Negative logit of an output token: -1.0 * 2 = -2.0 < -1.5 -> token 1 (dividing would keep 0).
    req = greedy(prompt=(2,), output=(0,), repetition_penalty=2.0)  # token 2: -9 -> -18
    assert s(rows([-1.0, -1.5, -9.0]), [req]).token_ids == [1]
    # A penalty below 1 encourages: 2.0 / 0.5 = 4.0 > 3.0 -> token 0.
    assert s(rows([2.0, 3.0]), [greedy(prompt=(0,), repetition_penalty=0.5)]).token_ids == [0]


def test_presence_and_frequency_penalties_on_output_tokens_only():
    logits = rows([1.0, 1.0, 1.0, 0.0])
    req = greedy(prompt=(0, 0, 3), output=(1, 1, 2), frequency_penalty=0.5, presence_penalty=0.25)
    out = Sampler._apply_penalties(logits, [req])
    # token 0: prompt only -> 1.0; token 1: 1 - 0.5*2 - 0.25 = -0.25; token 2: 1 - 0.5 - 0.25 = 0.25;
    # token 3: prompt only -> 0.0.
    assert out.tolist() == [[1.0, -0.25, 0.25, 0.0]]
    assert Sampler()(logits, [req]).token_ids == [0]


def test_penalties_apply_per_row():
    logits = rows([1.0, 0.9], [1.0, 0.9])
    reqs = [greedy(output=(0,), presence_penalty=0.5), greedy(output=(0,))]
    # Row 0: [0.5, 0.9] -> 1. Row 1 has no penalty -> 0.
    assert Sampler()(logits, reqs).token_ids == [1, 0]


def test_top_k_1_equals_greedy():
    torch.manual_seed(0)
    logits = torch.randn(8, 50) * 3
    reqs = [make_req(f"r{i}", top_k=1, temperature=1.3) for i in range(8)]
    out = Sampler(seed=123)(logits, reqs)
    assert out.token_ids == logits.argmax(dim=-1).tolist()


def test_small_top_p_keeps_only_the_top_token():
    torch.manual_seed(1)
    logits = torch.randn(8, 50)
    reqs = [make_req(f"r{i}", top_p=0.01) for i in range(8)]
    assert Sampler(seed=5)(logits, reqs).token_ids == logits.argmax(dim=-1).tolist()


def test_probs_top_k():
    probs = Sampler._probs(rows(log_p(P3)), [make_req(top_k=2)])
    # [0.5, 0.3] renormalized: 0.625, 0.375; token 2 dropped.
    assert probs[0].tolist() == pytest.approx([0.625, 0.375, 0.0], abs=1e-6)


def test_probs_top_p():
    probs = Sampler._probs(rows(log_p(P3)), [make_req(top_p=0.7)])
    # Mass before each token: 0, 0.5, 0.8. Token 2 is dropped (0.8 >= 0.7), token 1 kept (0.5 < 0.7).
    assert probs[0].tolist() == pytest.approx([0.625, 0.375, 0.0], abs=1e-6)


def test_probs_min_p():
    p = [0.5, 0.3, 0.15, 0.05]
    probs = Sampler._probs(rows(log_p(p)), [make_req(min_p=0.2)])
    # Threshold 0.2 * 0.5 = 0.1: only 0.05 goes; the rest is renormalized by 0.95.
    assert probs[0].tolist() == pytest.approx([0.5 / 0.95, 0.3 / 0.95, 0.15 / 0.95, 0.0], abs=1e-6)


def test_probs_temperature():
    probs = Sampler._probs(rows(log_p(P3)), [make_req(temperature=2.0)])
    # p ** (1/2), normalized.
    roots = [math.sqrt(x) for x in P3]
    assert probs[0].tolist() == pytest.approx([r / sum(roots) for r in roots], abs=1e-6)


def test_probs_filters_are_per_row():
    logits = rows(log_p(P3), log_p(P3), log_p(P3))
    probs = Sampler._probs(logits, [make_req(top_k=1), make_req(), make_req(top_p=0.7)])
    assert probs[0].tolist() == pytest.approx([1.0, 0.0, 0.0], abs=1e-6)
    assert probs[1].tolist() == pytest.approx(P3, abs=1e-6)  # no filter for this row
    assert probs[2].tolist() == pytest.approx([0.625, 0.375, 0.0], abs=1e-6)


def test_temperature_sampling_distribution():
    n = 2000
    logits = rows(*[log_p(P3)] * n)
    reqs = [make_req(f"r{i}") for i in range(n)]
    tokens = Sampler(seed=0)(logits, reqs).token_ids
    freqs = [tokens.count(t) / n for t in range(3)]
    # Standard deviation of a frequency at n = 2000: at most 0.011; allow 0.035.
    assert freqs == pytest.approx(P3, abs=0.035)


def test_seeded_request_sampling_distribution():
    req = make_req(seed=42, temperature=0.5)
    # Temperature 0.5 squares the probabilities: 0.25, 0.09, 0.04 over 0.38.
    expected = [0.25 / 0.38, 0.09 / 0.38, 0.04 / 0.38]
    s = Sampler()
    logits = rows(log_p(P3))
    tokens = []
    for _ in range(2000):  # one draw per output position, as the worker appends each token
        tokens.append(s(logits, [req]).token_ids[0])
        req.all_token_ids.append(tokens[-1])
    freqs = [tokens.count(t) / 2000 for t in range(3)]
    assert freqs == pytest.approx(expected, abs=0.035)


def test_seeded_noise_is_exponential_and_a_function_of_seed_and_position():
    from scipy import stats

    from tokenmill.worker.sampler import seeded_exponentials

    seeds, positions = (0, 1, -5, 2**63 - 1), (0, 1, 99)
    e = torch.cat([seeded_exponentials(seed, pos, 2000) for seed in seeds for pos in positions])
    assert bool((e > 0).all())
    assert stats.kstest(e.numpy(), "expon").pvalue > 1e-4  # a false alarm once in 10^4 runs
    same = seeded_exponentials(7, 3, 50)
    assert torch.equal(same, seeded_exponentials(7, 3, 50))
    assert not torch.equal(same, seeded_exponentials(7, 4, 50))
    assert not torch.equal(same, seeded_exponentials(8, 3, 50))


def test_seeded_draws_survive_logits_rounded_differently():
    """What prefix caching does to a float32 request: logits a few ulps apart. A seeded draw moves only
    when the two best scores of its race swap (none in these 1000 draws); a draw at one uniform number
    against the cumulative sum over the vocabulary (the unseeded way) moved 9 of them."""
    torch.manual_seed(0)
    x = torch.randn(1000, 49152) * 2.0  # a long tail, and 50 tokens well above it
    x[:, :50] += torch.randn(1000, 50) * 3 + 6
    y = x + torch.randn_like(x) * 1e-5
    reqs = [make_req(f"r{i}", seed=i, temperature=1.0) for i in range(1000)]
    a, b = Sampler()(x, reqs).token_ids, Sampler()(y, reqs).token_ids
    assert a == b


def test_seeded_request_is_reproducible_regardless_of_the_batch():
    torch.manual_seed(3)
    own = torch.randn(6, 30)  # the seeded request's logits at 6 steps
    others = torch.randn(6, 3, 30)
    params = dict(seed=1234, temperature=0.9)

    alone_req = make_req("s", **params)
    alone_sampler = Sampler(seed=0)
    alone = []
    for i in range(6):
        alone.append(alone_sampler(own[i : i + 1], [alone_req]).token_ids[0])
        alone_req.all_token_ids.append(alone[-1])

    mixed_req = make_req("s", **params)
    batch = [make_req("u"), make_req("t", seed=7), mixed_req, make_req("k", top_k=5, top_p=0.9)]
    mixed_sampler = Sampler(seed=99)  # another engine seed changes nothing for a seeded request
    mixed = []
    for i in range(6):
        logits = torch.cat([others[i, :2], own[i : i + 1], others[i, 2:]])
        mixed.append(mixed_sampler(logits, batch).token_ids[2])
        mixed_req.all_token_ids.append(mixed[-1])
    assert mixed == alone
    # And a different seed gives a different sequence (30 tokens, 6 draws: a clash is very unlikely).
    other_req = make_req("s2", seed=4321, temperature=0.9)
    other = []
    for i in range(6):
        other.append(Sampler()(own[i : i + 1], [other_req]).token_ids[0])
        other_req.all_token_ids.append(other[-1])
    assert other != alone


def test_seeded_tokens_are_the_same_with_drafts():
    """A seeded request verifying drafts emits the very tokens it draws one position at a time: kept
    drafts where they equal those, then the draw at the first mismatch, for either kind of row."""
    torch.manual_seed(4)
    logits = torch.randn(5, 40) * 0.5  # flat: a draft is often wrong, so both outcomes come up
    for params in ({"temperature": 1.0}, {"temperature": 0.8, "top_p": 0.9, "top_k": 20}):
        for seed in range(20):
            req = make_req(output=(3, 1), seed=seed, **params)
            one = []
            for i in range(5):
                one.append(Sampler()(logits[i : i + 1], [req]).token_ids[0])
                req.all_token_ids.append(one[-1])
            del req.all_token_ids[-5:]
            for wrong in range(5):  # drafts right up to position `wrong`, then one that is not
                draft = [*one[:wrong], (one[wrong] + 1) % 40][:4]
                got = sampler_module.Sampler()(logits[: len(draft) + 1], [req], [draft]).token_ids[0]
                assert got == one[: len(got)] and len(got) == min(wrong, 4) + 1


def test_unseeded_requests_follow_the_engine_seed():
    logits = rows(*[[0.0] * 50] * 4)
    a = Sampler(seed=11)(logits, [make_req(f"r{i}") for i in range(4)]).token_ids
    b = Sampler(seed=11)(logits, [make_req(f"r{i}") for i in range(4)]).token_ids
    assert a == b


def test_logprobs_of_the_raw_distribution():
    logits = rows([1.0, 2.0, 0.5, -1.0])
    lp = torch.log_softmax(logits[0], dim=-1)
    out = Sampler()(logits, [greedy(logprobs=2)])
    (res,) = out.logprobs
    assert out.token_ids == [1] and res.token_id == 1
    assert res.logprob == pytest.approx(lp[1].item(), abs=1e-6)
    assert [t for t, _ in res.top] == [1, 0]
    assert [v for _, v in res.top] == pytest.approx([lp[1].item(), lp[0].item()], abs=1e-6)
    assert res.top[0][1] >= res.top[1][1]


def test_logprobs_ignore_bias_and_penalties():
    logits = rows([1.0, 2.0, 0.5, -1.0])
    lp = torch.log_softmax(logits[0], dim=-1)
    req = greedy(logprobs=3, logit_bias={3: 100.0}, output=(1,), repetition_penalty=1.5)
    (res,) = Sampler()(logits, [req]).logprobs
    assert res.token_id == 3  # forced by the bias...
    assert res.logprob == pytest.approx(lp[3].item(), abs=1e-6)  # ...but scored by the raw model
    assert [t for t, _ in res.top] == [1, 0, 2]
    values = [v for _, v in res.top]
    assert values == sorted(values, reverse=True) and len(values) == 3


def test_logprobs_zero_and_none_in_one_batch():
    logits = rows([0.0, 1.0], [0.0, 1.0], [2.0, 0.0])
    out = Sampler()(logits, [greedy(logprobs=0), greedy(), greedy(logprobs=1)])
    assert out.logprobs[0] is not None and out.logprobs[0].top == []
    assert out.logprobs[0].logprob == pytest.approx(-math.log1p(math.exp(-1.0)), abs=1e-6)
    assert out.logprobs[1] is None
    assert out.logprobs[2].token_id == 0 and [t for t, _ in out.logprobs[2].top] == [0]


def test_logprobs_of_a_sampled_token():
    n = 50
    logits = rows(*[log_p(P3)] * n)
    out = Sampler(seed=2)(logits, [make_req(f"r{i}", logprobs=3) for i in range(n)])
    for t, res in zip(out.token_ids, out.logprobs, strict=True):
        assert res.token_id == t
        assert res.logprob == pytest.approx(math.log(P3[t]), abs=1e-5)
        assert [tok for tok, _ in res.top] == [0, 1, 2]


# -- parameters at the edge of what the API accepts (issue #11: each of these once killed the engine) --


def extreme(**params) -> Request:
    """A request whose params skip validation, as a router or remote client could hand them over."""
    req = make_req(output=(1, 2), prompt=(0, 1, 2))
    for k, v in params.items():
        setattr(req.params, k, v)
    return req


@pytest.mark.parametrize(
    "params",
    [
        {"temperature": 1.0, "repetition_penalty": 1e-300},
        {"temperature": 1.0, "repetition_penalty": 1e300},
        {"temperature": 1e-300},
        {"temperature": 1.0, "top_k": 10**30},
        {"temperature": 0.0, "stop_token_ids": [10**6, -(10**6)], "min_tokens": 5},
        {"temperature": 1.0, "logit_bias": {0: math.inf, 1: -math.inf, 10**9: 1.0}},
        {"temperature": 1.0, "logit_bias": {0: -math.inf, 1: -math.inf, 2: -math.inf, 3: -math.inf}},
    ],
)
def test_extreme_parameters_give_a_token_not_an_error(params: dict) -> None:
    reqs = [extreme(**params), make_req("ok", temperature=0.0)]
    res = Sampler(0)(rows([1.0, 3.0, 2.0, 0.5], [0.1, 0.2, 5.0, 0.3]), reqs)
    assert res.errors == {} and all(0 <= t < 4 for t in res.token_ids)
    assert res.token_ids[1] == 2, "the well-behaved neighbour is unaffected"


def test_a_request_that_breaks_sampling_fails_alone(monkeypatch) -> None:
    s = Sampler(0)
    real = s._sample

    def flaky(logits, reqs, *args):
        if any(r.request_id == "bad" for r in reqs):
            raise RuntimeError("boom")
        return real(logits, reqs, *args)

    monkeypatch.setattr(s, "_sample", flaky)
    res = s(rows([0.0, 1.0, 0.0], [2.0, 0.0, 0.0], [0.0, 0.0, 3.0]), [greedy(), make_req("bad"), greedy()])
    assert res.errors == {1: "RuntimeError"} and res.token_ids == [1, -1, 2]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_bitmask_masks_sampling_but_not_logprobs_or_the_callers_logits(dtype):
    """A grammar's bitmask decides the token; logprobs stay the model's, and the logits the model
    runner passed in are left as they were (the sampler masks a copy)."""
    logits = rows([0.0, 3.0, 1.0, 2.0], [4.0, 0.0, 1.0, 0.0]).to(dtype)
    before = logits.clone()
    bitmask = torch.tensor([[0b0101], [0b1110]], dtype=torch.int32)  # row 0: tokens 0, 2; row 1: 1, 2, 3
    out = Sampler()(logits, [greedy(logprobs=0), greedy()], None, bitmask)
    assert out.token_ids == [2, 2]
    assert torch.equal(logits, before)
    expected = torch.log_softmax(before[0].float(), dim=-1)[2]
    assert out.logprobs[0].logprob == pytest.approx(float(expected), abs=1e-6)


def test_the_draw_never_picks_a_token_without_mass():
    from tokenmill.worker.sampler import _inverse_cdf

    probs = torch.tensor([[0.0, 0.5, 0.0, 0.5, 0.0], [0.0, 0.0, 0.0, 0.0, 2.0]]).repeat(5000, 1)
    drawn = _inverse_cdf(probs, 1 - torch.rand(len(probs), generator=torch.Generator().manual_seed(0)))
    assert set(drawn[0::2].tolist()) == {1, 3} and set(drawn[1::2].tolist()) == {4}
    share = (drawn[0::2] == 1).float().mean().item()
    assert abs(share - 0.5) < 0.03  # sd 0.007 at 5000 draws
