"""The router: one EngineClient over a fleet of engine workers, so the OpenAI and KServe fronts serve a
fleet unchanged.

Each request goes to the worker a policy picks (cluster/policies/); `kv` weighs how much of the
request's prompt each worker already holds, from the index its KV events keep, against the load the
router has put on it. Workers come and go: one whose connection drops, whose process exits, or who stops
answering leaves rotation; requests of a lost worker that have not yet produced a token are sent to
another worker, streams already under way end with an error; a worker that answers again rejoins with
its index rebuilt from its events.

Every request ends, answered or with an error, within stated bounds of silence: a retry goes only to a
worker heard from within SUSPECT_AFTER_S (one that has proven it answers), waiting at most
RouterSettings.retry_wait_s for one; a request whose worker sends nothing (no output, no heartbeat) for
RouterSettings.lost_after_s after it was sent is taken as lost (retried if it has no token yet, else
ended with an error), well before the client's own heartbeat timeout.
"""

from tokenmill.cluster.router.client import RouterEngineClient
from tokenmill.cluster.router.settings import MAX_RETRIES, SUSPECT_AFTER_S, RouterSettings
from tokenmill.cluster.router.worker import Worker, in_pool, reachable

__all__ = [
    "MAX_RETRIES",
    "SUSPECT_AFTER_S",
    "RouterEngineClient",
    "RouterSettings",
    "Worker",
    "in_pool",
    "reachable",
]
