"""The worker's side of speculative decoding: after sampling, learn how the last drafts fared and ask
the proposer for the next ones."""

from __future__ import annotations

from collections.abc import Sequence

from tokenmill.config import SpeculativeConfig
from tokenmill.worker.request_state import CachedRequestState
from tokenmill.worker.spec_decode.draft_length import DraftLength
from tokenmill.worker.spec_decode.proposer import ProposeInput, Proposer
from tokenmill.worker.step import ModelRunnerOutput


class Speculator:
    def __init__(self, config: SpeculativeConfig, proposer: Proposer) -> None:
        self.config = config
        self.proposer = proposer
        self.lengths = DraftLength(config.num_speculative_tokens, config.max_batch_tokens)

    def propose(
        self, sampled: list[CachedRequestState], output: ModelRunnerOutput, drafts: list[list[int]]
    ) -> dict[str, list[int]]:
        cap = self.lengths.cap(len(sampled))
        batch = []
        for st, new, draft in zip(sampled, output.sampled_token_ids, drafts, strict=True):
            if not new:
                continue  # the request failed
            self.lengths.observe(st.request_id, len(draft), len(new) - 1)
            k = self.lengths.length(st.request_id, cap)
            if k and st.params.speculative:
                batch.append(
                    ProposeInput(st.request_id, [*st.all_token_ids, *new], len(st.prompt_token_ids), k)
                )
        if not batch:
            return {}
        guesses = self.proposer.propose(batch)
        return {b.request_id: g for b, g in zip(batch, guesses, strict=True) if g}

    def forget(self, request_ids: Sequence[str], outputs: dict[str, list[int]] | None) -> None:
        self.proposer.forget(request_ids, outputs)
        if outputs is not None:
            self.lengths.forget(request_ids)


def make_speculator(config: SpeculativeConfig, **draft_kwargs: object) -> Speculator | None:
    if config.method is None:
        return None
    kind = config.method.split(":", 1)[0]
    if kind == "ngram":
        from tokenmill.worker.spec_decode.ngram import NgramProposer

        return Speculator(config, NgramProposer(config.prompt_lookup_min, config.prompt_lookup_max))
    if kind == "suffix":
        from tokenmill.worker.spec_decode.suffix import SuffixProposer

        proposer = SuffixProposer(
            config.suffix_max_tree_depth, config.suffix_max_cached_requests, config.suffix_min_token_prob
        )
        return Speculator(config, proposer)
    raise ValueError(f"speculative method {config.method!r} is not available in this worker")
