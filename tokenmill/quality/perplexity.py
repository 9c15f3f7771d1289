"""Perplexity on a fixed English text that ships with every CPython: the documentation topics of
`pydoc_data` (the text of `help("topics")`), so no data set is downloaded and every machine scores
the same words (for one Python version: the text changes little between releases, and the version is
reported beside the figure).

The text is cut into chunks; each chunk's first tokens are its prompt and the rest are fed one decode
step at a time (teacher forcing, tokenmill/quality/fidelity.py), so the score covers the path a
server's decode steps take (batched decode attention, the quantized matmuls at decode batch sizes), not
only one long prefill."""

from __future__ import annotations

import math
import sys
from dataclasses import dataclass

import torch

from tokenmill.llm import LLM
from tokenmill.quality.fidelity import ForcedRun, forced_run


def reference_text() -> str:
    from pydoc_data.topics import topics

    return "\n\n".join(topics[k].strip() for k in sorted(topics))


def text_version() -> str:
    return f"pydoc_data.topics of Python {sys.version.split()[0]}"


@dataclass
class Perplexity:
    value: float
    tokens: int  # scored tokens
    nll: float  # mean negative log-likelihood per token, nats


def chunks(llm: LLM, n: int, prompt_len: int, steps: int) -> tuple[list[list[int]], list[list[int]]]:
    """`n` distinct chunks of the text: (prompts of `prompt_len` tokens, the `steps` tokens after each)."""
    ids = llm.tokenizer.encode(reference_text())
    size = prompt_len + steps
    if len(ids) < n * size:
        raise ValueError(f"the text has {len(ids)} tokens; {n} chunks of {size} need more")
    prompts, targets, seen = [], [], set()
    for start in range(0, len(ids) - size + 1, size):
        p = ids[start : start + prompt_len]
        if tuple(p) in seen:  # prompts identify the requests: skip a repeated opening
            continue
        seen.add(tuple(p))
        prompts.append(p)
        targets.append(ids[start + prompt_len : start + size])
        if len(prompts) == n:
            break
    return prompts, targets


def perplexity(llm: LLM, n: int = 32, prompt_len: int = 16, steps: int = 128) -> Perplexity:
    """exp(mean NLL) of `n` x `steps` tokens of the text, each predicted from the text before it in
    its chunk; the chunks are decoded together, as one batch."""
    prompts, targets = chunks(llm, n, prompt_len, steps)
    run = forced_run(llm, prompts, steps, ForcedRun(targets, []))
    nll = 0.0
    count = 0
    for lp, tgt in zip(run.logprobs, targets, strict=True):
        picked = lp[torch.arange(len(tgt)), torch.tensor(tgt)]
        nll -= float(picked.double().sum())
        count += len(tgt)
    mean = nll / count
    return Perplexity(math.exp(mean), count, mean)
