"""Turn a step's logits into next tokens, request by request, in one batch; verify speculative drafts.

Order of operations: grammar mask, logit bias, min_tokens (EOS and stop ids masked, unless a grammar
allows nothing else), repetition / presence / frequency penalties, then greedy argmax, or temperature,
top-k, top-p, min-p and a draw. Logprobs are those of the model's raw distribution (before any of the
above), as in vLLM.

A seeded request draws by an exponential race on noise that depends only on its seed and the output
position being drawn (`Sampler._race`), so its tokens depend on its seed, its position and its logits
only: not on the rest of the batch, the step, preemption, prefix caching or speculation, and a rounding
change in the logits moves a draw as rarely as it moves a greedy one. (A stateful generator per request
drew once per verification step plus once per draft, so a request's tokens changed with the drafts it
was offered.) Unseeded rows draw at one uniform number each from the sampler's generator: the first
token whose cumulative probability reaches it, in one fused pass per row.

Drafts (speculative decoding) are verified by drawing at every position what the request would draw
there without drafts, and keeping drafts while they equal the draw; the draw at the first mismatch (or
after the last draft) is the request's own next token. A draft x is so kept with probability p(x), and
at a mismatch the token is distributed as p without x: rejection sampling with q = 1 (Leviathan et al.
2023), so the output is distributed exactly as token-by-token sampling, and for a seeded request it is
the very tokens token-by-token sampling gives (up to the logits' rounding in the verifying pass).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

import torch

from tokenmill.models.ops import TorchOps
from tokenmill.sampling_params import SamplingParams
from tokenmill.structured.bitmask import apply_bitmask
from tokenmill.worker.request_state import CachedRequestState
from tokenmill.worker.step import TokenLogprobs

log = logging.getLogger(__name__)


@dataclass
class SampleResult:
    # Per request: the accepted draft tokens, then one token of the target's own (empty on error).
    token_ids: list[list[int]]
    logprobs: list[list[TokenLogprobs] | None]
    # Request index -> what went wrong, for requests that could not be sampled.
    errors: dict[int, str] = field(default_factory=dict)


class _DraftRow:
    """A request as seen from one draft position: its history extended by the drafts before it, so
    penalties and min_tokens apply as if those drafts had been sampled. The history is only built
    when a penalty asks for it (most requests have none)."""

    __slots__ = (
        "_prefix",
        "_state",
        "eos_token_ids",
        "num_output_tokens",
        "params",
        "request_id",
    )

    def __init__(self, st: CachedRequestState, prefix: list[int]) -> None:
        self._state, self._prefix = st, prefix
        self.request_id = st.request_id
        self.params = st.params
        self.eos_token_ids = st.eos_token_ids
        self.num_output_tokens = st.num_output_tokens + len(prefix)

    @property
    def all_token_ids(self) -> list[int]:
        return [*self._state.all_token_ids, *self._prefix]

    @property
    def output_token_ids(self) -> list[int]:
        return [*self._state.output_token_ids, *self._prefix]


Row = CachedRequestState | _DraftRow


class Sampler:
    def __init__(self, seed: int = 0, ops: TorchOps | None = None) -> None:
        """`ops`: whose `sample_rows` draws plain temperature samples and `argmax_rows` greedy ones (the
        model's: fused C++ on a CPU). `seed`: the generator of unseeded requests' draws."""
        self.generator = torch.Generator().manual_seed(seed)
        self.ops = ops or TorchOps()

    def __call__(
        self,
        logits: torch.Tensor,
        reqs: list[CachedRequestState],
        drafts: list[list[int]] | None = None,
        bitmask: torch.Tensor | None = None,
    ) -> SampleResult:
        """Sample the batch: logits has one row per request, or 1 + len(drafts[i]) rows for request i
        (a row per draft position and one after the last). Drafts are verified by rejection sampling.
        `bitmask` (one row per logits row) forbids tokens a grammar rules out. A request whose
        parameters make sampling fail fails alone."""
        drafts = drafts or [[] for _ in reqs]
        try:
            return self._sample(logits, reqs, drafts, bitmask)
        except Exception:
            log.exception("sampling a batch of %d failed; sampling its requests one by one", len(reqs))
        tokens: list[list[int]] = []
        lps: list[list[TokenLogprobs] | None] = []
        errors: dict[int, str] = {}
        first = 0
        for i, r in enumerate(reqs):
            rows = slice(first, first + 1 + len(drafts[i]))
            first = rows.stop
            try:
                one = self._sample(logits[rows], [r], [drafts[i]], None if bitmask is None else bitmask[rows])
                tokens.append(one.token_ids[0])
                lps.append(one.logprobs[0])
            except Exception as e:
                log.exception("sampling failed for request %s", r.request_id)
                tokens.append([])
                lps.append(None)
                errors[i] = type(e).__name__
        return SampleResult(tokens, lps, errors)

    def _sample(
        self,
        logits: torch.Tensor,
        reqs: list[CachedRequestState],
        drafts: list[list[int]],
        bitmask: torch.Tensor | None,
    ) -> SampleResult:
        # Without masks, penalties or drafts the logits are only read: no float32 copy of them.
        plain = bitmask is None and not any(drafts) and not any(_edits_logits(r) for r in reqs)
        raw = logits if plain else logits.float()
        rows: list[Row] = []
        first: list[int] = []  # each request's first row
        for r, d in zip(reqs, drafts, strict=True):
            first.append(len(rows))
            rows.append(r)
            rows.extend(_DraftRow(r, d[: j + 1]) for j in range(len(d)))
        # `raw` must stay as it is when it is the caller's tensor or when logprobs (the model's, before
        # masks and penalties) are read from it; otherwise it is edited in place: a copy of the batch's
        # logits costs as much as applying a grammar mask (page faults on a fresh 6 MB tensor).
        keep_raw = raw is logits or any(r.params.logprobs is not None for r in reqs)
        masked = raw
        if bitmask is not None:
            masked = raw.clone() if keep_raw else raw
            apply_bitmask(masked, bitmask)
        if not plain:  # `plain` already found that no row edits its logits
            logits = self._apply_penalties(masked, rows, owned=masked is not raw or not keep_raw)

        targets = [0] * len(rows)  # each row's draw: what the request takes at that position
        greedy_rows = [j for j, r in enumerate(rows) if r.params.greedy]
        if greedy_rows:
            whole = len(greedy_rows) == len(rows)
            best = self.ops.argmax_rows(logits if whole else logits[greedy_rows]).tolist()
            for j, t in zip(greedy_rows, best, strict=True):
                targets[j] = t
        rand_rows = [j for j, r in enumerate(rows) if not r.params.greedy]
        if rand_rows:
            self._draw(logits, rows, rand_rows, targets)
        out: list[list[int]] = []
        for d, f in zip(drafts, first, strict=True):
            a = 0
            while a < len(d) and d[a] == targets[f + a]:
                a += 1
            out.append([*d[:a], targets[f + a]])
        return SampleResult(out, self._logprobs(raw, reqs, first, out))

    @staticmethod
    def _logprobs(
        raw: torch.Tensor, reqs: list[CachedRequestState], first: list[int], out: list[list[int]]
    ) -> list[list[TokenLogprobs] | None]:
        """Each asking request's logprobs of its emitted tokens, from the model's raw logits."""
        logprobs: list[list[TokenLogprobs] | None] = [None] * len(reqs)
        want = [i for i, r in enumerate(reqs) if r.params.logprobs is not None]
        if want:
            lp_rows = [first[i] + j for i in want for j in range(len(out[i]))]
            lp = torch.log_softmax(raw[lp_rows].float(), dim=-1)
            n_row = 0
            for i in want:
                n = reqs[i].params.logprobs or 0
                entries = []
                for t in out[i]:
                    top_v, top_i = (
                        lp[n_row].topk(n) if n else (torch.empty(0), torch.empty(0, dtype=torch.long))
                    )
                    entries.append(
                        TokenLogprobs(
                            t, float(lp[n_row, t]), list(zip(top_i.tolist(), top_v.tolist(), strict=True))
                        )
                    )
                    n_row += 1
                logprobs[i] = entries
        return logprobs

    def _draw(self, logits: torch.Tensor, rows: list[Row], rand_rows: list[int], targets: list[int]) -> None:
        """The random rows' tokens into `targets`: seeded rows by a race on their own noise (`_race`), the
        others at one uniform number each from the sampler's generator: rows without top-k/p/min-p by the
        fused kernel (one pass per row, no probs tensor), the rest from their cut distribution."""
        seeded = [j for j in rand_rows if rows[j].params.seed is not None]
        if seeded:
            self._race(logits, rows, seeded, targets)
        unseeded = [j for j in rand_rows if rows[j].params.seed is None]
        if not unseeded:
            return
        u = 1 - torch.rand(len(unseeded), generator=self.generator)  # in (0, 1]
        fused = [n for n, j in enumerate(unseeded) if not _truncates(rows[j].params)]
        cut = [n for n, j in enumerate(unseeded) if _truncates(rows[j].params)]
        if fused:
            ids = [unseeded[n] for n in fused]
            # All rows random and plain (the usual case): the logits themselves, not a 6 MB copy.
            picked = logits if len(ids) == logits.shape[0] else logits[ids]
            temps = torch.tensor([rows[j].params.temperature for j in ids], dtype=torch.float32)
            drawn = self.ops.sample_rows(picked, temps, u[fused]).tolist()
            for n, (j, t) in enumerate(zip(ids, drawn, strict=True)):
                if t < 0:
                    # No distribution (logits overflowed, or every token ruled out): the argmax, as
                    # _probs does for such rows.
                    t = int(picked[n].float().nan_to_num(nan=-torch.inf).argmax())
                targets[j] = t
        if cut:
            ids = [unseeded[n] for n in cut]
            probs = self._probs(logits[ids].float(), [rows[j] for j in ids])
            for j, t in zip(ids, _inverse_cdf(probs, u[cut]).tolist(), strict=True):
                targets[j] = t

    def _race(self, logits: torch.Tensor, rows: list[Row], seeded: list[int], targets: list[int]) -> None:
        """Seeded rows: the token with the largest log p_i - log E_i, where E_i ~ Exp(1) is drawn for
        token i from the request's seed and output position alone (`seeded_exponentials`). That is a
        draw from p (the exponential race; torch.multinomial and vLLM's sampler use it too), and it moves
        only when a rounding change in the logits reorders the two best scores: as rare as a greedy
        near-tie. A draw at one uniform number against the cumulative sum (the unseeded rows' way) moves
        whenever the sum over the 49k tokens before it rounds differently: 0.5% of draws for logits 1e-6
        apart in float32. The price: ~0.6 ms of noise per seeded row and step (49k tokens)."""
        plain = [j for j in seeded if not _truncates(rows[j].params)]
        cut = [j for j in seeded if _truncates(rows[j].params)]
        vocab = logits.shape[-1]
        for group in (plain, cut):
            if not group:
                continue
            x = logits[group].float()
            if group is cut:
                score = self._probs(x, [rows[j] for j in group]).log()  # cut tokens: -inf, never drawn
            else:
                temps = torch.tensor([rows[j].params.temperature for j in group], dtype=torch.float32)
                score = x / temps.unsqueeze(1)
            noise = torch.stack(
                [seeded_exponentials(rows[j].params.seed, rows[j].num_output_tokens, vocab) for j in group]
            )
            score = score.double() - noise.to(score.device).log()
            best = score.nan_to_num(nan=-torch.inf).max(dim=-1)
            for n, (j, t) in enumerate(zip(group, best.indices.tolist(), strict=True)):
                if not bool(torch.isfinite(best.values[n])):
                    # No distribution (logits overflowed, or every token ruled out): the argmax.
                    t = int(x[n].nan_to_num(nan=-torch.inf).argmax())
                targets[j] = t

    @staticmethod
    def _apply_penalties(logits: torch.Tensor, reqs: list[Row], owned: bool = False) -> torch.Tensor:
        """Logit bias, min_tokens and the repetition penalties, on `logits` itself if `owned`, else
        on a copy made only when some row needs them."""
        touched: list[int] = []
        risky = False  # a bias or penalty was applied: values may overflow (min_tokens only writes -inf)
        for i, r in enumerate(reqs):
            p = r.params
            banned = _banned(r)
            if not _edits_logits(r, banned):
                continue
            if not touched and not owned:
                logits = logits.clone()
            touched.append(i)
            risky = risky or bool(p.logit_bias or p.repetition_penalty != 1.0)
            risky = risky or bool(p.presence_penalty or p.frequency_penalty)
            row = logits[i]
            vocab = row.shape[0]
            if p.logit_bias:
                ids = torch.tensor([t for t in p.logit_bias if 0 <= t < vocab], dtype=torch.long)
                vals = torch.tensor([p.logit_bias[t] for t in ids.tolist()], dtype=row.dtype)
                row.index_add_(0, ids, vals)
            banned = {t for t in banned if 0 <= t < vocab}  # ids past the vocabulary never come up
            if banned:
                ban = torch.tensor(sorted(banned), dtype=torch.long)
                kept = row[ban] if p.structured is not None else None
                row[ban] = float("-inf")
                if kept is not None and bool(row.amax() == float("-inf")):
                    # The grammar is complete and allows only its end: the constrained output wins over
                    # min_tokens (the scheduler ends a constrained request on it whatever min_tokens says).
                    row[ban] = kept
            if p.repetition_penalty != 1.0:
                seen = torch.tensor(sorted(set(r.all_token_ids)), dtype=torch.long)
                vals = row[seen]
                row[seen] = torch.where(vals > 0, vals / p.repetition_penalty, vals * p.repetition_penalty)
            if (p.presence_penalty or p.frequency_penalty) and r.num_output_tokens:
                counts = torch.bincount(torch.tensor(r.output_token_ids, dtype=torch.long), minlength=vocab)
                counts = counts[:vocab].to(row.dtype)
                row -= p.frequency_penalty * counts + p.presence_penalty * (counts > 0).to(row.dtype)
        if touched:
            # Extreme but accepted parameters (a tiny repetition penalty, huge biases) can overflow;
            # NaN would poison the draw, so such logits become impossible tokens instead. Over the
            # touched rows at once: per row, these small passes added up to milliseconds at 32 rows.
            whole = len(touched) == logits.shape[0]
            index = torch.tensor(touched, dtype=torch.long)
            part = logits if whole else logits.index_select(0, index)
            if risky:
                torch.nan_to_num_(part, nan=float("-inf"), posinf=torch.finfo(part.dtype).max)
            dead = part.amax(dim=1) == float("-inf")
            if bool(dead.any()):
                part[dead] = 0.0  # every token ruled out: no choice is better than another
            if not whole:
                logits.index_copy_(0, index, part)
        return logits

    @staticmethod
    def _probs(logits: torch.Tensor, reqs: list[Row]) -> torch.Tensor:
        temps = [r.params.temperature for r in reqs]
        if any(t != 1.0 for t in temps):  # temperature 1 (the default) divides by nothing
            logits = logits / torch.tensor(temps, dtype=logits.dtype).unsqueeze(1)
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


_MASK64 = (1 << 64) - 1


def _mix64(x: int) -> int:
    """SplitMix64's finalizer: a bijection of 64-bit integers whose outputs pass BigCrush."""
    x = (x + 0x9E3779B97F4A7C15) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


def seeded_exponentials(seed: int, position: int, n: int) -> torch.Tensor:
    """n Exp(1) numbers (float64) for the draw of output token `position` (0-based) of a request with
    `seed`: a function of the three only, whatever else the engine does (the same on every CPU). From a
    generator seeded by a hash of seed and position; float64 so that the smallest numbers, which decide
    draws of unlikely tokens, are not rounded to a few values; never 0 (its log would be -inf)."""
    g = torch.Generator().manual_seed(_mix64(_mix64(seed & _MASK64) ^ position) >> 1)
    # -log(1 - u) rather than exponential_(), which took 1.9 ms for 49k numbers against 0.7 ms this way.
    u = torch.rand(n, dtype=torch.float64, generator=g)
    return torch.log1p(u.neg_()).neg_().clamp_(min=2.0**-60)


def _inverse_cdf(probs: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """One token per row of `probs` [R, V] (rows need not sum to 1): the first whose cumulative mass
    reaches u[r] in (0, 1] times the row's total. torch.multinomial draws one exponential per vocabulary
    entry instead, which took 46 ms for 32 rows of 49k (1.2 ms this way). u > 0, so the token found
    always has mass of its own (a zero-probability token is never drawn)."""
    cdf = probs.cumsum(dim=-1)
    target = u.to(cdf.dtype).unsqueeze(1) * cdf[:, -1:]
    return torch.searchsorted(cdf, target)[:, 0].clamp_(max=probs.shape[-1] - 1)


def _banned(r: Row) -> set[int]:
    """Tokens min_tokens rules out for this row now (stop ids, EOS unless ignored)."""
    p = r.params
    if r.num_output_tokens >= p.min_tokens:
        return set()
    return set(p.stop_token_ids) | (set() if p.ignore_eos else set(r.eos_token_ids))


def _edits_logits(r: Row, banned: set[int] | None = None) -> bool:
    """Whether a logit bias, min_tokens or a penalty changes this row's logits (`banned`: _banned(r),
    when the caller has it already)."""
    p = r.params
    return bool(
        p.logit_bias
        or (_banned(r) if banned is None else banned)  # min_tokens with nothing to ban changes nothing
        or p.repetition_penalty != 1.0
        or p.presence_penalty
        or p.frequency_penalty
    )


def _truncates(p: SamplingParams) -> bool:
    """Whether top-k, top-p or min-p cut this row's distribution."""
    return bool(p.top_k or p.top_p < 1.0 or p.min_p)
