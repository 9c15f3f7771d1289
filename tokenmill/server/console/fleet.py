"""The console's view of a fleet: one row per worker, the router's recent placements and the planner's
recent decisions, read off the router and planner objects as they are (duck-typed with getattr: the
console must not make the cluster code carry anything for it, and a router of another kind shows what
it has).

Workers launched here listen on ipc:// sockets, which are files of the server's temporary folder:
their rows carry the worker's name (local-N), never that address, and the reasons shown are scrubbed of
socket addresses and file paths.
"""

from __future__ import annotations

import itertools
import re
import time
from typing import Any

RECENT_PLACEMENTS = 20
RECENT_DECISIONS = 8
RECENT_CHANGES = 10
DECISIONS_SCANNED = 2_000  # how far back changes are looked for: a poll's cost stays bounded

_SOCKET = re.compile(r"\b(?:ipc|inproc)://\S*")
_PATH = re.compile(r"(?<![\w.:/])/(?:[\w.+-]+/)*[\w.+-]+")


def scrub(text: object) -> str | None:
    """A reason fit to show: without local socket addresses or file paths."""
    if text is None:
        return None
    return _PATH.sub("<path>", _SOCKET.sub("<socket>", str(text)))


def worker_name(w: Any) -> str:  # noqa: ANN401 - a router's Worker
    name = str(getattr(w, "name", "") or getattr(w, "url", "") or f"worker-{getattr(w, 'slot', '?')}")
    return f"worker-{getattr(w, 'slot', '?')}" if _SOCKET.match(name) or name.startswith("/") else name


def worker_state(w: Any) -> str:  # noqa: ANN401
    if getattr(w, "draining", False):
        return "draining"
    if getattr(w, "up", False):
        return "up"
    # Never joined: still loading (or never reachable); joined before: it was lost and is not back yet.
    return "down" if getattr(w, "joins", 0) else "starting"


def worker_row(w: Any, now: float) -> dict[str, Any]:  # noqa: ANN401
    client = getattr(w, "client", None)
    stats = getattr(client, "stats", None) if getattr(w, "up", False) else None
    info = getattr(w, "info", None) or {}
    heard = getattr(client, "last_heard", None)
    return {
        "name": worker_name(w),
        "role": getattr(w, "role", None) or info.get("kv_role") or None,
        "state": worker_state(w),
        "running": getattr(stats, "num_running", None),
        "waiting": getattr(stats, "num_waiting", None),
        "kv_usage": getattr(stats, "kv_cache_usage", None),
        "in_flight": len(getattr(w, "active", None) or ()),  # requests the router has on it
        "joins": getattr(w, "joins", 0),
        "heard_s_ago": round(now - heard, 2) if isinstance(heard, float) and heard > 0 else None,
        "last_error": scrub(getattr(w, "last_error", None)) if worker_state(w) != "up" else None,
    }


def placements(client: Any, names: dict[int, str]) -> list[dict[str, Any]]:  # noqa: ANN401
    """The router's most recent placements, newest first: the worker and the prompt blocks credited as
    already cached there (the router's log keeps no time nor prompt length per placement)."""
    log = getattr(client, "placements", None)
    if not log:
        return []
    recent = list(itertools.islice(reversed(log.items()), RECENT_PLACEMENTS))
    return [
        {"request": str(rid)[:24], "worker": names.get(slot, f"worker-{slot}"), "overlap_blocks": overlap}
        for rid, (slot, overlap) in recent
    ]


def router_summary(client: Any) -> dict[str, Any]:  # noqa: ANN401
    st = getattr(client, "stats_router", None)
    settings = getattr(client, "settings", None)
    decisions = getattr(st, "decisions", None) or {}
    return {
        "policy": getattr(settings, "policy", None),
        "decisions": sum(decisions.values()),
        "overlap_blocks": getattr(st, "overlap_blocks", None),
        "request_blocks": getattr(st, "request_blocks", None),
        "retries": getattr(st, "retries", None),
        "worker_losses": getattr(st, "worker_losses", None),
        "restarts": getattr(client, "restarts", None),  # workers started again after they died
    }


def _decision(d: Any, now: float) -> dict[str, Any]:  # noqa: ANN401 - a planner Decision
    return {
        "age_s": round(now - getattr(d, "time", now), 1),
        "current": getattr(d, "current", None),
        "target": getattr(d, "target", None),
        "reason": scrub(getattr(d, "reason", "")),
    }


def planner_view(loop: Any, now: float) -> list[dict[str, Any]]:  # noqa: ANN401
    pools = []
    for pool in getattr(loop, "pools", []):
        planner = getattr(pool, "planner", None)
        config = getattr(planner, "config", None)
        # The newest only: the planner keeps up to 100k decisions, and a poll must not copy them all.
        newest_first = itertools.islice(reversed(getattr(planner, "decisions", ()) or ()), DECISIONS_SCANNED)
        recent = list(newest_first)[::-1]
        changes = [d for d in reversed(recent) if getattr(d, "current", -1) >= 0 and d.target != d.current]
        try:
            serving, starting, draining = pool.connector.counts()
        except Exception:  # noqa: BLE001 - a connector that cannot say now: the rest still shows
            serving = starting = draining = None
        pools.append(
            {
                "pool": getattr(pool, "name", "all"),
                "mode": getattr(config, "mode", None),
                "min_workers": getattr(config, "min_workers", None),
                "max_workers": getattr(config, "max_workers", None),
                "interval_s": getattr(config, "interval_s", None),
                "target": getattr(pool, "target", None),
                "serving": serving,
                "starting": starting,
                "draining": draining,
                "scaled_up": getattr(pool, "ups", 0),
                "scaled_down": getattr(pool, "downs", 0),
                "recent": [_decision(d, now) for d in reversed(recent[-RECENT_DECISIONS:])],
                "changes": [_decision(d, now) for d in changes[:RECENT_CHANGES]],
            }
        )
    return pools


def fleet_view(client: Any, loop: Any) -> dict[str, Any] | None:  # noqa: ANN401
    """The fleet as the console shows it (`loop`: the planner's, or None); None for a server of one
    engine (no per-worker stats)."""
    workers = getattr(client, "workers", None)
    if workers is None or getattr(client, "worker_stats", None) is None:
        return None
    now = time.monotonic()
    live = [w for w in list(workers) if not getattr(w, "retired", False)]
    names = {getattr(w, "slot", i): worker_name(w) for i, w in enumerate(live)}
    return {
        "workers": [worker_row(w, now) for w in live],
        "router": router_summary(client),
        "placements": placements(client, names),
        "planner": planner_view(loop, now) if loop is not None else None,
    }
