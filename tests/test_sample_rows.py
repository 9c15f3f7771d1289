"""Temperature sampling by inverse CDF (`sample_rows`): every kernel build and the PyTorch reference
against a float64 inversion of the same distribution at the same uniform numbers.

A draw is right when the token's cumulative interval, computed in float64, holds u * total to within
float32 summation error (relative 1e-4 of the total: 49k terms summed in float32 in another order), and
the token has probability mass of its own. Rows that are no distribution give -1.
"""

from __future__ import annotations

import math

import pytest
import torch

from tokenmill.kernels import cpu_kernels
from tokenmill.kernels.isa import cpu_summary, get_level, level_names
from tokenmill.models.ops import TorchOps
from tokenmill.sampling_params import SamplingParams
from tokenmill.worker.request_state import CachedRequestState
from tokenmill.worker.sampler import Sampler
from tokenmill.worker.step import NewRequestData

REL = 1e-4


@pytest.fixture(scope="module", params=["torch", *level_names()])
def sample_rows(request):
    if request.param == "torch":
        return TorchOps().sample_rows
    level = get_level(request.param)
    if not level.supported():
        pytest.skip(f"this CPU cannot run the {level.name} build: it has {cpu_summary()}")
    return cpu_kernels(level.name).sample_rows


def reference_check(logits: torch.Tensor, temps: torch.Tensor, u: torch.Tensor, got: torch.Tensor) -> None:
    x = logits.double()
    t = (x - x.amax(dim=-1, keepdim=True)) / temps.double().unsqueeze(1)
    p = torch.where(t < -87, torch.zeros_like(t), t.exp())
    cdf = p.cumsum(dim=-1)
    total = cdf[:, -1]
    for r in range(x.shape[0]):
        tok = int(got[r])
        assert 0 <= tok < x.shape[1], f"row {r}: token {tok}"
        assert p[r, tok] > 0, f"row {r}: token {tok} has no probability"
        target = float(u[r]) * float(total[r])
        lo = float(cdf[r, tok - 1]) if tok else 0.0
        hi = float(cdf[r, tok])
        slack = REL * float(total[r])
        assert lo - slack <= target <= hi + slack, f"row {r}: u*total {target} outside [{lo}, {hi}] of {tok}"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("vocab", [49152, 301])
def test_draws_invert_the_cdf(sample_rows, dtype, vocab) -> None:
    g = torch.Generator().manual_seed(vocab)
    rows = 24
    logits = (torch.randn(rows, vocab, generator=g) * 3).to(dtype)
    logits[::3, ::2] = -math.inf  # masked tokens (a grammar, a ban) are never drawn
    temps = torch.tensor([1.0, 0.7, 2.0, 1e-4, 0.05, 1.3] * 4)
    u = 1 - torch.rand(rows, generator=g)
    u[0], u[1], u[2] = 1.0, 1e-9, 0.5  # the ends of (0, 1]
    got = sample_rows(logits, temps, u)
    assert got.dtype == torch.long and got.shape == (rows,)
    reference_check(logits, temps, u, got)


def test_strided_rows(sample_rows) -> None:
    g = torch.Generator().manual_seed(1)
    wide = torch.randn(8, 700, generator=g)
    logits = wide[:, 50:650]  # rows 700 apart: the step's logits may be a view
    temps, u = torch.ones(8), 1 - torch.rand(8, generator=g)
    reference_check(logits, temps, u, sample_rows(logits, temps, u))


def test_a_sharp_row_gives_its_argmax(sample_rows) -> None:
    logits = torch.tensor([[0.0, 5.0, 4.999, -1.0]])
    for u in (1e-9, 0.5, 1.0):
        assert int(sample_rows(logits, torch.tensor([1e-6]), torch.tensor([u]))[0]) == 1


def test_rows_that_are_no_distribution(sample_rows) -> None:
    logits = torch.zeros(4, 100)
    logits[0, 7] = math.nan
    logits[1, 3] = math.inf
    logits[2] = -math.inf
    got = sample_rows(logits, torch.ones(4), torch.full((4,), 0.5))
    assert got[:3].tolist() == [-1, -1, -1]
    assert 0 <= int(got[3]) < 100


def _req(rid: str, seed: int | None, temperature: float) -> CachedRequestState:
    p = SamplingParams(temperature=temperature, seed=seed)
    new = NewRequestData(rid, [0], [], p, [], [], 0)
    return CachedRequestState(new)


@pytest.mark.parametrize("level", level_names())
def test_sampler_draws_the_same_tokens_with_either_ops(level) -> None:
    """The served sampler with the fused kernel draws what it draws with the PyTorch reference: same
    uniform numbers, same inversion (a mismatch would need u within float error of a boundary)."""
    lv = get_level(level)
    if not lv.supported():
        pytest.skip(f"this CPU cannot run the {lv.name} build: it has {cpu_summary()}")
    from tokenmill.models.ops import CpuFusedOps

    g = torch.Generator().manual_seed(5)
    logits = (torch.randn(12, 5000, generator=g) * 2).to(torch.bfloat16)

    def draw(ops: TorchOps) -> list[list[int]]:
        reqs = [_req(f"r{i}", i if i % 3 == 0 else None, [1.0, 0.8, 0.0][i % 3]) for i in range(12)]
        return Sampler(seed=3, ops=ops)(logits, reqs).token_ids

    assert draw(CpuFusedOps(level)) == draw(TorchOps())
