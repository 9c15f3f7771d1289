"""Turn a step's logits into next tokens, request by request, in one batch.

Order of operations: logit bias, min_tokens (EOS masked), repetition / presence / frequency
penalties, then greedy argmax, or temperature, top-k, top-p, min-p and a draw. Requests with a seed
draw from their own generator, so their output does not depend on what else is in the batch.
Logprobs are those of the model's raw distribution (before any of the above), as in vLLM.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

import torch

from tokenmill.worker.request_state import CachedRequestState
from tokenmill.worker.step import TokenLogprobs

log = logging.getLogger(__name__)


@dataclass
class SampleResult:
    token_ids: list[int]
    logprobs: list[TokenLogprobs | None]
    # Row index -> what went wrong, for requests that could not be sampled (their token id is -1).
    errors: dict[int, str] = field(default_factory=dict)


class Sampler:
    def __init__(self, seed: int = 0) -> None:
        self.generator = torch.Generator().manual_seed(seed)

    def __call__(self, logits: torch.Tensor, reqs: list[CachedRequestState]) -> SampleResult:
        """Sample the batch; a request whose parameters make sampling fail fails alone."""
        try:
            return self._sample(logits, reqs)
        except Exception:
            log.exception("sampling a batch of %d failed; sampling its requests one by one", len(reqs))
        tokens: list[int] = []
        lps: list[TokenLogprobs | None] = []
        errors: dict[int, str] = {}
        for i, r in enumerate(reqs):
            try:
                one = self._sample(logits[i : i + 1], [r])
                tokens.append(one.token_ids[0])
                lps.append(one.logprobs[0])
            except Exception as e:
                log.exception("sampling failed for request %s", r.request_id)
                tokens.append(-1)
                lps.append(None)
                errors[i] = type(e).__name__
        return SampleResult(tokens, lps, errors)

    def _sample(self, logits: torch.Tensor, reqs: list[CachedRequestState]) -> SampleResult:
        logits = logits.float()
        raw = logits
        logits = self._apply_penalties(logits, reqs)
        tokens = torch.empty(len(reqs), dtype=torch.long)

        greedy = [i for i, r in enumerate(reqs) if r.params.greedy]
        if greedy:
            # max().indices, not argmax(): the same first-maximum index, ~3x faster on CPU here.
            if len(greedy) == len(reqs):
                tokens = logits.max(dim=-1).indices
            else:
                tokens[greedy] = logits[greedy].max(dim=-1).indices
        rand = [i for i, r in enumerate(reqs) if not r.params.greedy]
        if rand:
            probs = self._probs(logits[rand], [reqs[i] for i in rand])
            for j, i in enumerate(rand):
                g = reqs[i].generator
                if g is not None:
                    tokens[i] = torch.multinomial(probs[j], 1, generator=g)[0]
            unseeded = [j for j, i in enumerate(rand) if reqs[i].generator is None]
            if unseeded:
                drawn = torch.multinomial(probs[unseeded], 1, generator=self.generator)[:, 0]
                for j, t in zip(unseeded, drawn.tolist(), strict=True):
                    tokens[rand[j]] = t

        token_list = tokens.tolist()
        logprobs: list[TokenLogprobs | None] = [None] * len(reqs)
        want = [i for i, r in enumerate(reqs) if r.params.logprobs is not None]
        if want:
            lp = torch.log_softmax(raw[want], dim=-1)
            for j, i in enumerate(want):
                n = reqs[i].params.logprobs or 0
                top_v, top_i = lp[j].topk(n) if n else (torch.empty(0), torch.empty(0, dtype=torch.long))
                logprobs[i] = TokenLogprobs(
                    token_list[i],
                    float(lp[j, token_list[i]]),
                    list(zip(top_i.tolist(), top_v.tolist(), strict=True)),
                )
        return SampleResult(token_list, logprobs)

    @staticmethod
    def _apply_penalties(logits: torch.Tensor, reqs: list[CachedRequestState]) -> torch.Tensor:
        cloned = False
        for i, r in enumerate(reqs):
            p = r.params
            needs = (
                p.logit_bias
                or r.num_output_tokens < p.min_tokens
                or p.repetition_penalty != 1.0
                or p.presence_penalty
                or p.frequency_penalty
            )
            if not needs:
                continue
            if not cloned:
                logits, cloned = logits.clone(), True
            row = logits[i]
            vocab = row.shape[0]
            if p.logit_bias:
                ids = torch.tensor([t for t in p.logit_bias if 0 <= t < vocab], dtype=torch.long)
                vals = torch.tensor([p.logit_bias[t] for t in ids.tolist()], dtype=row.dtype)
                row.index_add_(0, ids, vals)
            if r.num_output_tokens < p.min_tokens:
                banned = set(p.stop_token_ids) | (set() if p.ignore_eos else set(r.eos_token_ids))
                banned = {t for t in banned if 0 <= t < vocab}  # ids past the vocabulary never come up
                if banned:
                    row[torch.tensor(sorted(banned), dtype=torch.long)] = float("-inf")
            if p.repetition_penalty != 1.0:
                seen = torch.tensor(sorted(set(r.all_token_ids)), dtype=torch.long)
                vals = row[seen]
                row[seen] = torch.where(vals > 0, vals / p.repetition_penalty, vals * p.repetition_penalty)
            if (p.presence_penalty or p.frequency_penalty) and r.num_output_tokens:
                counts = torch.bincount(torch.tensor(r.output_token_ids, dtype=torch.long), minlength=vocab)
                counts = counts[:vocab].to(row.dtype)
                row -= p.frequency_penalty * counts + p.presence_penalty * (counts > 0).to(row.dtype)
            # Extreme but accepted parameters (a tiny repetition penalty, huge biases) can overflow;
            # NaN would poison the draw, so such logits become impossible tokens instead.
            torch.nan_to_num_(row, nan=float("-inf"), posinf=torch.finfo(row.dtype).max)
            if not bool(torch.isfinite(row).any()):
                row.zero_()  # every token ruled out: no choice is better than another
        return logits

    @staticmethod
    def _probs(logits: torch.Tensor, reqs: list[CachedRequestState]) -> torch.Tensor:
        temps = torch.tensor([r.params.temperature for r in reqs], dtype=logits.dtype)
        logits = logits / temps.unsqueeze(1)
        top_k = [r.params.top_k for r in reqs]
        top_p = [r.params.top_p for r in reqs]
        min_p = [r.params.min_p for r in reqs]
        if any(top_k) or any(p < 1.0 for p in top_p) or any(min_p):
            sorted_logits, order = logits.sort(dim=-1, descending=True)
            vocab = logits.shape[-1]
            rank = torch.arange(vocab).unsqueeze(0)
            k = torch.tensor([min(k, vocab) if k > 0 else vocab for k in top_k]).unsqueeze(1)
            drop = rank >= k
            probs = sorted_logits.masked_fill(drop, float("-inf")).softmax(dim=-1)
            # top-p: drop a token once the mass before it already reaches p (the first always stays).
            before = probs.cumsum(dim=-1) - probs
            drop |= before >= torch.tensor(top_p, dtype=probs.dtype).unsqueeze(1)
            drop |= probs < torch.tensor(min_p, dtype=probs.dtype).unsqueeze(1) * probs[:, :1]
            drop[:, 0] = False
            sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
            logits = torch.empty_like(logits).scatter_(1, order, sorted_logits)
        probs = logits.softmax(dim=-1)
        # A row that is not a distribution (temperatures so small that logits overflow): the draw
        # becomes the argmax, which is what such a temperature asks for.
        bad = ~torch.isfinite(probs).all(dim=-1)
        if bool(bad.any()):
            rows = bad.nonzero()[:, 0]
            best = logits[rows].nan_to_num(nan=-torch.inf).argmax(-1)
            probs[rows] = torch.nn.functional.one_hot(best, probs.shape[-1]).to(probs.dtype)
        return probs
