"""A step as plain data: what the scheduler decides (SchedulerOutput) and what the workers return
(ModelRunnerOutput).

This is the line between the engine core, which decides what runs, and the workers, which run it. No
live object crosses it: only ids, token ids, block ids and sampling parameters, so a step can go to a
worker in another process (or, later, on another host) as it is. Running requests travel as diffs:
the worker keeps what it was told before (tokens, block table) until the request
is preempted or finished.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from tokenmill.sampling_params import SamplingParams


@dataclass
class TokenLogprobs:
    token_id: int
    logprob: float
    top: list[tuple[int, float]] = field(default_factory=list)  # (token id, logprob), best first


@dataclass
class NewRequestData:
    """A request the workers do not hold yet: a new one, or one coming back after a preemption."""

    request_id: str
    prompt_token_ids: list[int]
    output_token_ids: list[int]  # tokens sampled before a preemption (empty for a new request)
    sampling_params: SamplingParams
    eos_token_ids: list[int]
    block_ids: list[int]
    num_computed_tokens: int  # tokens whose KV is already in the blocks (prefix-cache hits)
    lora_slot: int = -1  # the LoRA slot it runs on (-1: the base model)


@dataclass
class RunningRequestData:
    """A request the workers already hold, as a diff against what they were told last step."""

    request_id: str
    new_token_ids: list[int]  # tokens the workers have not seen (those sampled since)
    new_block_ids: list[int]
    num_computed_tokens: int


@dataclass
class SchedulerOutput:
    new_requests: list[NewRequestData] = field(default_factory=list)
    running_requests: list[RunningRequestData] = field(default_factory=list)
    # Tokens to compute this step per request, in the order the requests were scheduled.
    num_scheduled_tokens: dict[str, int] = field(default_factory=dict)
    # Draft tokens to verify per request (speculative decoding): they follow the request's known tokens
    # and are counted in its num_scheduled_tokens.
    spec_token_ids: dict[str, list[int]] = field(default_factory=dict)
    # The workers drop these requests' state (a preempted one comes back as a new request with its output
    # so far; a seeded one's draws depend only on its seed and output position, so they carry on).
    preempted_req_ids: list[str] = field(default_factory=list)
    finished_req_ids: list[str] = field(default_factory=list)
    # Opaque to the engine loop: metadata for a KV connector (offload, prefill/decode transfer).
    kv_connector_metadata: Any = None
    # LoRA slots to read an adapter into before this step runs: slot -> (lora id, adapter directory).
    lora_loads: dict[int, tuple[int, str]] = field(default_factory=dict)

    @property
    def num_batched_tokens(self) -> int:
        return sum(self.num_scheduled_tokens.values())

    @property
    def scheduled_ids(self) -> list[str]:
        return list(self.num_scheduled_tokens)

    def num_computed_before(self) -> dict[str, int]:
        """Each scheduled request's computed tokens when this step starts."""
        d = {r.request_id: r.num_computed_tokens for r in self.new_requests}
        d.update((r.request_id, r.num_computed_tokens) for r in self.running_requests)
        return d


@dataclass
class KVConnectorOutput:
    """What the worker side of the KV connectors reports after a step, keyed by connector name (the
    registry's, worker/kv_connector.py), so that the scheduler side hands each connector its own. Under
    tensor or pipeline parallelism every rank reports its own, and the executor combines them
    (worker/kv_connector.py's RankCombiner): a load or a send is done when every rank has it."""

    # Background loads that ended: connector -> request id -> leading blocks that arrived intact.
    loads_done: dict[str, dict[str, int]] = field(default_factory=dict)
    # Kept blocks a reader is done with: connector -> request ids (disaggregation's prefill side).
    sends_done: dict[str, list[str]] = field(default_factory=dict)
    # Changes a connector's worker side made on its own: connector -> (kind, tier, block key), kind
    # "stored" or "removed" (a file tier's writes and evictions, for the KV events).
    events: dict[str, list[tuple[str, str, bytes]]] = field(default_factory=dict)
    # The worker sides' counters since start (one flat dict; each connector's keys are its own).
    stats: dict[str, int] = field(default_factory=dict)


@dataclass
class ModelRunnerOutput:
    # One entry per request that sampled this step (a request still in its prompt does not).
    req_ids: list[str] = field(default_factory=list)
    # The drafts a request had verified that were accepted, then one token of the target's own.
    sampled_token_ids: list[list[int]] = field(default_factory=list)
    logprobs: list[list[TokenLogprobs] | None] = field(default_factory=list)
    # Prompt logprobs of the rows this step computed, per request (the prompt tokens they predict).
    prompt_logprobs: dict[str, list[TokenLogprobs]] = field(default_factory=dict)
    # Requests with max_tokens 0 whose prompt this step finished: they sample nothing and are done.
    prompt_done: list[str] = field(default_factory=list)
    # Embedding requests whose prompt this step finished: request id -> the pooled hidden state
    # (float32 bytes). They sample nothing and are done.
    pooled: dict[str, bytes] = field(default_factory=dict)
    # Request id -> what went wrong, for requests that could not be sampled (they fail alone).
    errors: dict[str, str] = field(default_factory=dict)
    # Of those, the requests that failed by their own doing (a grammar with no continuation): why, for
    # their clients.
    client_errors: dict[str, str] = field(default_factory=dict)
    execute_seconds: float = 0.0  # the forward pass and sampling, as the worker timed them
    # Speculative decoding: the proposer's guesses of each request's next tokens, for the next step.
    spec_token_ids: dict[str, list[int]] = field(default_factory=dict)
    # What the worker side of the KV connectors reports after the step (None: no connector).
    kv_connector_output: KVConnectorOutput | None = None
    # LoRA slots whose adapter could not be read (slot -> why); their requests are in `errors`.
    lora_failed: dict[int, str] = field(default_factory=dict)
