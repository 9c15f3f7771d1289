"""What a worker remembers of a request between steps: its tokens, its block table, its generator."""

from __future__ import annotations

import torch

from tokenmill.sampling_params import SamplingParams
from tokenmill.worker.step import NewRequestData


class CachedRequestState:
    def __init__(self, new: NewRequestData, generator: torch.Generator | None) -> None:
        self.request_id = new.request_id
        self.prompt_token_ids = new.prompt_token_ids
        self.all_token_ids: list[int] = [*new.prompt_token_ids, *new.output_token_ids]
        self.params: SamplingParams = new.sampling_params
        self.eos_token_ids = frozenset(new.eos_token_ids)
        self.block_ids: list[int] = list(new.block_ids)
        self.generator = generator

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.all_token_ids) - len(self.prompt_token_ids)

    @property
    def output_token_ids(self) -> list[int]:
        return self.all_token_ids[len(self.prompt_token_ids) :]
