"""How the router picks a worker for a request: one policy per file, each a `RoutingPolicy`, found by
name here (the `--router` flag takes these names)."""

from __future__ import annotations

from tokenmill.cluster.policies.base import DEFAULT_PREFILL_WEIGHT, Candidates, RoutingPolicy
from tokenmill.cluster.policies.kv import KVApproxPolicy, KVPolicy
from tokenmill.cluster.policies.least_load import LeastLoadPolicy
from tokenmill.cluster.policies.random_pick import RandomPolicy
from tokenmill.cluster.policies.round_robin import RoundRobinPolicy
from tokenmill.cluster.policies.session import SessionPolicy

REGISTRY: dict[str, type[RoutingPolicy]] = {
    p.name: p
    for p in (KVPolicy, KVApproxPolicy, RoundRobinPolicy, RandomPolicy, LeastLoadPolicy, SessionPolicy)
}
POLICIES = tuple(REGISTRY)


def make_policy(
    name: str, temperature: float = 0.0, prefill_weight: float = DEFAULT_PREFILL_WEIGHT, seed: int = 0
) -> RoutingPolicy:
    cls = REGISTRY.get(name)
    if cls is None:
        raise ValueError(f"unknown router policy {name!r}; available: {', '.join(POLICIES)}")
    return cls(temperature, prefill_weight, seed)


__all__ = ["POLICIES", "REGISTRY", "Candidates", "RoutingPolicy", "make_policy"]
