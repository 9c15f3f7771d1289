"""Teacher-forced fidelity: how closely one engine configuration tracks a reference configuration.

Free-running greedy comparisons (tokens until the first divergence) are dominated by near-ties: one
flipped token early in a sequence and everything after it differs, whichever path was more accurate.
Teacher forcing removes that: every configuration is fed the same tokens (the reference's greedy
continuation), so each position compares two next-token distributions over the same context. The
positions are decode steps of a batch, so the decode-attention kernel and the prefill path are both
measured, as a server would run them.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from tokenmill.llm import LLM
from tokenmill.sampling_params import SamplingParams


@dataclass
class ForcedRun:
    """Per prompt: the tokens fed after the prompt and the log-probabilities [steps, vocab] before each."""

    tokens: list[list[int]]
    logprobs: list[torch.Tensor]


@dataclass
class Fidelity:
    """One configuration against the reference over the same forced positions."""

    positions: int
    top1_agreement: float  # fraction of positions whose argmax equals the reference's
    mean_kl: float  # mean KL(reference || this), nats
    max_kl: float
    greedy_prefix_tokens: (
        int  # free-running: greedy tokens equal to the reference before each first divergence
    )


def forced_run(
    llm: LLM, prompts: Sequence[list[int]], steps: int, forced: ForcedRun | None = None
) -> ForcedRun:
    """Generate `steps` tokens per prompt in one batch, recording every step's log-softmax.

    With `forced`, each step's token is replaced by the reference's, so the contexts stay identical;
    without it the run is free greedy decoding (and becomes the reference for other runs).
    """
    keys = [tuple(p) for p in prompts]
    if len(set(keys)) != len(keys):
        raise ValueError("prompts must be distinct (they identify the requests)")
    index = {k: i for i, k in enumerate(keys)}
    rows: list[list[torch.Tensor]] = [[] for _ in prompts]
    runner = llm.engine.runner
    sample = runner.sampler

    def recording_sampler(logits, reqs, *args):  # noqa: ANN001, ANN002, ANN202 - the sampler's own signature
        result = sample(logits, reqs, *args)  # no drafts here: one logits row and one token per request
        lp = torch.log_softmax(logits.float(), dim=-1)
        for j, r in enumerate(reqs):
            i = index[tuple(r.prompt_token_ids)]
            pos = len(rows[i])
            rows[i].append(lp[j].clone())
            if forced is not None:
                result.token_ids[j] = [forced.tokens[i][pos]]
        return result

    runner.sampler = recording_sampler
    try:
        params = SamplingParams(temperature=0, max_tokens=steps, ignore_eos=True)
        outs = llm.generate([list(p) for p in prompts], params)
    finally:
        runner.sampler = sample
    tokens = [list(o.outputs[0].token_ids) for o in outs]
    return ForcedRun(tokens, [torch.stack(r) for r in rows])


def compare(reference: ForcedRun, run: ForcedRun, free: ForcedRun | None = None) -> Fidelity:
    """Metrics of a forced `run` against `reference`; `free` (a free greedy run) adds the prefix count."""
    ref = torch.cat(reference.logprobs)
    got = torch.cat(run.logprobs)
    kl = (ref.exp() * (ref - got)).sum(-1)
    agree = (ref.argmax(-1) == got.argmax(-1)).float().mean().item()
    prefix = 0
    if free is not None:
        for a, b in zip(reference.tokens, free.tokens, strict=True):
            n = next((k for k, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b)))
            prefix += n
    return Fidelity(len(ref), agree, kl.mean().item(), kl.max().item(), prefix)
