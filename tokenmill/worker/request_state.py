"""What a worker remembers of a request between steps: its tokens and its block table. (A seeded request's
draws need nothing more: they are a function of its seed and output position, worker/sampler.py.)"""

from __future__ import annotations

from typing import Any

from tokenmill.sampling_params import SamplingParams
from tokenmill.worker.step import NewRequestData


class CachedRequestState:
    def __init__(self, new: NewRequestData) -> None:
        self.request_id = new.request_id
        self.prompt_token_ids = new.prompt_token_ids
        self.all_token_ids: list[int] = [*new.prompt_token_ids, *new.output_token_ids]
        self.params: SamplingParams = new.sampling_params
        self.eos_token_ids = frozenset(new.eos_token_ids)
        self.block_ids: list[int] = list(new.block_ids)
        self.lora_slot = new.lora_slot
        # An embedding request's pooled rows so far (float32 sum, row count): "mean" pooling sums the
        # hidden states of every chunk of its prompt.
        self.pool_sum: Any = None
        self.pool_rows = 0

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.all_token_ids) - len(self.prompt_token_ids)

    @property
    def output_token_ids(self) -> list[int]:
        return self.all_token_ids[len(self.prompt_token_ids) :]
