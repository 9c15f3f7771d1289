"""Workers as Ray actors: Ray places them (each declares the CPUs it needs), restarts one that dies,
and tells the router where each listens. Needs `pip install tokenmill[ray]`.

Each actor serves the engine protocol on a tcp:// port of its node, with its KV events on two more,
from a thread of its own (the actor's methods stay free to answer where it listens). The router asks
the actor for its address every time it (re)joins a worker: an actor Ray restarted listens anew.
"""

from __future__ import annotations

import asyncio
import dataclasses
import os
import threading
from typing import Any

from tokenmill.cluster.router import RouterEngineClient, RouterSettings, Worker
from tokenmill.config import EngineConfig
from tokenmill.engine.client import EngineDeadError
from tokenmill.extras import require

NAMESPACE = "tokenmill"


class EngineActor:
    """The body of a Ray actor (wrapped with ray.remote when launched, so this module imports without
    ray)."""

    def __init__(self, config: EngineConfig, host: str | None = None) -> None:
        import ray

        from tokenmill.engine.engine_server import serve_engine
        from tokenmill.engine.protocol import worker_secret

        host = host or ray.util.get_node_ip_address()
        # Every port is taken by its own bind ("*": any free one), never picked first and bound later:
        # actors starting together raced for picked ports (one lost, "Address already in use"). The KV
        # event endpoints reach the router in the engine's own description, the engine's in address().
        ev = dataclasses.replace(
            config.kv_events,
            enable_kv_events=True,
            kv_events_endpoint=f"tcp://{host}:*",
            kv_events_replay_endpoint=f"tcp://{host}:*",
        )
        self.config = dataclasses.replace(config, kv_events=ev)
        self.url: str | None = None
        listening = threading.Event()

        def bound(endpoint: str) -> None:
            self.url = endpoint
            listening.set()

        self.thread = threading.Thread(
            target=serve_engine,
            args=(self.config, f"tcp://{host}:*"),
            kwargs={"bound": bound, "secret": worker_secret()},  # the fronts' secret, if set
            name="tokenmill-engine",
            daemon=True,
        )
        self.thread.start()
        listening.wait(timeout=60)  # the bind comes first, before the model loads

    def address(self) -> str:
        if self.url is None or not self.thread.is_alive():
            raise RuntimeError("the engine in this actor has stopped")
        return self.url

    def pid(self) -> int:
        return os.getpid()


class RayRouter(RouterEngineClient):
    """A router over `count` workers it starts as Ray actors (on the cluster at `address`, or a local
    Ray instance when there is none)."""

    def __init__(
        self,
        engine: EngineConfig,
        count: int,
        settings: RouterSettings,
        address: str | None = None,
        cpus_per_worker: float = 1.0,
        host: str | None = None,
        roles: list[str | None] | None = None,
    ) -> None:
        """`host`: the address workers listen on (default: their node's IP, as Ray knows it); `roles`:
        each worker's part in a disaggregated fleet."""
        require("ray", "serve --launcher ray")  # before anything starts: ray is imported only in _launch
        self.roles = roles or [None] * count
        self.engine, self.count, self.ray_address, self.cpus = engine, count, address, cpus_per_worker
        self.host = host
        self.actors: list[Any] = []
        self._started_ray = False
        names = [f"ray-{i}" for i in range(count)]
        super().__init__([f"ray://{n}" for n in names], settings, names=names)
        for w, role in zip(self.workers, self.roles, strict=False):
            w.role = role

    async def start(self) -> None:
        await asyncio.to_thread(self._launch)
        await super().start()

    def _launch(self) -> None:
        import ray

        if not ray.is_initialized():
            os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
            ray.init(
                address=self.ray_address,
                namespace=NAMESPACE,
                include_dashboard=False,
                log_to_driver=False,
                ignore_reinit_error=True,
            )
            self._started_ray = True
        for i in range(self.count):
            self.actors.append(self._actor(i))

    def _actor(self, i: int) -> Any:  # noqa: ANN401 - a Ray actor handle
        import ray

        threads = max(1, int(self.cpus))
        cfg = dataclasses.replace(
            self.engine, num_threads=self.engine.num_threads or threads, seed=self.engine.seed + i
        )
        if i < len(self.roles) and self.roles[i] is not None:
            kt = dataclasses.replace(cfg.kv_transfer, kv_role=self.roles[i])
            if self.host:  # peers on other nodes read blocks from the address the worker listens on
                kt = dataclasses.replace(kt, kv_transfer_host=self.host)
            cfg = dataclasses.replace(cfg, kv_transfer=kt)
        # max_restarts=-1: Ray brings a dead worker back; the router finds its new address.
        return (
            ray.remote(EngineActor)
            .options(name=f"tokenmill-worker-{i}-{os.getpid()}", num_cpus=self.cpus, max_restarts=-1)
            .remote(cfg, self.host)
        )

    async def add_worker(self, role: str | None = None) -> Worker:
        """One more worker actor (the planner's, of a role in a disaggregated fleet); Ray places it
        where a CPU is free."""
        i = len(self.actors)
        self.roles.extend([None] * (i + 1 - len(self.roles)))
        self.roles[i] = role
        self.actors.append(await asyncio.to_thread(self._actor, i))
        w = Worker(i, f"ray://ray-{i}", f"ray-{i}", role=role)
        self.workers.append(w)  # slots stay the actors' indexes: never reused
        self.join_new(w)
        return w

    async def remove_worker(self, w: Worker, drain_timeout_s: float = 600.0) -> None:
        """Drain a worker, then end its actor."""
        import ray

        await self.drain(w, drain_timeout_s)
        ray.kill(self.actors[w.slot], no_restart=True)

    async def _resolve(self, w: Worker) -> None:
        import ray

        try:
            w.url = await asyncio.to_thread(ray.get, self.actors[w.slot].address.remote(), timeout=10)
        except Exception as e:  # noqa: BLE001 - dead, restarting, or not placed yet: try again later
            raise EngineDeadError(f"ray actor {w.name} has no address yet: {type(e).__name__}") from None

    def actor_pid(self, slot: int) -> int:
        import ray

        return ray.get(self.actors[slot].pid.remote(), timeout=30)

    async def shutdown(self) -> None:
        await super().shutdown()
        import ray

        for actor in self.actors:
            ray.kill(actor, no_restart=True)
        if self._started_ray:
            ray.shutdown()
