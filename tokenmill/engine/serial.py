"""msgpack encoding of what crosses the engine-process boundary: requests in, outputs and stats out.

Plain tuples/dicts of builtins: fast to pack, and readable from any language a remote worker or a
router might be written in.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import msgpack

from tokenmill.engine.engine_core import EngineCoreOutput, EngineStats
from tokenmill.engine.request import EngineRequest, FinishReason
from tokenmill.engine.sampler import TokenLogprobs
from tokenmill.sampling_params import SamplingParams


def pack(obj: Any) -> bytes:
    return msgpack.packb(obj, use_bin_type=True)


def unpack(data: bytes) -> Any:
    return msgpack.unpackb(data, raw=False, strict_map_key=False)


def request_to_wire(r: EngineRequest) -> dict:
    params = dataclasses.asdict(r.sampling_params)
    params["logit_bias"] = [[k, v] for k, v in params["logit_bias"].items()]
    return {
        "id": r.request_id,
        "prompt": r.prompt_token_ids,
        "params": params,
        "eos": sorted(r.eos_token_ids),
        "arrival": r.arrival_time,
        "priority": r.priority,
        "salt": r.cache_salt,
    }


def request_from_wire(d: dict) -> EngineRequest:
    params = dict(d["params"])
    params["logit_bias"] = {int(k): v for k, v in params["logit_bias"]}
    return EngineRequest(
        request_id=d["id"],
        prompt_token_ids=d["prompt"],
        sampling_params=SamplingParams(**params),
        eos_token_ids=frozenset(d["eos"]),
        arrival_time=d["arrival"],
        priority=d["priority"],
        cache_salt=d["salt"],
    )


def output_to_wire(o: EngineCoreOutput) -> dict:
    d = dict(o.__dict__)  # shallow: asdict's deep copy of every list is wasted work each engine step
    d["finish_reason"] = None if o.finish_reason is None else o.finish_reason.value
    if o.new_logprobs is not None:
        d["new_logprobs"] = [[lp.token_id, lp.logprob, [list(t) for t in lp.top]] for lp in o.new_logprobs]
    return d


def output_from_wire(d: dict) -> EngineCoreOutput:
    d = dict(d)
    if d["finish_reason"] is not None:
        d["finish_reason"] = FinishReason(d["finish_reason"])
    if d["new_logprobs"] is not None:
        d["new_logprobs"] = [
            TokenLogprobs(t, lp, [(a, b) for a, b in top]) for t, lp, top in d["new_logprobs"]
        ]
    return EngineCoreOutput(**d)


def stats_to_wire(s: EngineStats) -> dict:
    return dataclasses.asdict(s)


def stats_from_wire(d: dict) -> EngineStats:
    return EngineStats(**d)
