"""From the server's config to the EngineClient it serves through: one engine process of its own, one
remote worker, or a router over a fleet (workers launched here, attached by address, or both)."""

from __future__ import annotations

import dataclasses
import logging
import os
from pathlib import Path

from tokenmill.cluster.disagg import DisaggSettings, parse_disaggregate
from tokenmill.cluster.discovery import Discovery, make_discovery
from tokenmill.cluster.router import RouterEngineClient, RouterSettings, Worker
from tokenmill.config import EngineConfig
from tokenmill.engine.client import EngineClient, LocalEngineLauncher, MPEngineClient, ZmqEngineClient
from tokenmill.server.config import ServerConfig

log = logging.getLogger(__name__)


def engine_client_for(config: ServerConfig) -> EngineClient:
    urls, f = list(config.worker_url), config.fleet
    n, lo, hi = config.worker_range
    if f.planner is not None:
        if f.planner not in ("load", "sla"):
            raise ValueError(f'--planner must be "load" or "sla", got {f.planner!r}')
        if urls or f.discovery is not None:
            raise ValueError("--planner scales workers it starts: leave out --worker-url and --discovery")
        if f.planner == "sla" and not f.planner_capacity_rps:
            raise ValueError(
                "--planner sla needs --planner-capacity-rps (one worker's requests/s within the targets)"
            )
        # A fleet that may scale to zero still starts one worker: the front learns the model's shape
        # (context length, block size) from it before it serves; it is stopped once the fleet is idle.
        n = max(n, 1)
        settings = router_settings(config)
        check_scale_to_zero(config)
        if lo == 0:
            settings.scale_to_zero = True
            settings.cold_start_timeout_s = f.cold_start_timeout_s
            settings.cold_start_max_waiting = f.cold_start_max_waiting
        roles: list[str | None] = [None] * n
        if f.disaggregate:
            # The planner sizes each pool within the bounds of the whole fleet: it starts as given.
            settings.disagg = disagg_settings(config)
            n = settings.disagg.num_workers
            if not lo <= n <= hi or hi < 2:
                raise ValueError(
                    f"--disaggregate {f.disaggregate} starts {n} workers: --workers {lo}..{hi} must "
                    "allow them (and at least 2: one per pool)"
                )
            if f.planner_prometheus_url:
                raise ValueError("--planner-prometheus-url reads one pool: leave it out with --disaggregate")
            if f.planner == "sla" and not f.planner_prefill_capacity_rps:
                raise ValueError(
                    "--planner sla with --disaggregate needs --planner-prefill-capacity-rps (one prefill "
                    "worker's requests/s within the TTFT target)"
                )
            roles = list(settings.disagg.roles())
        if f.launcher == "ray":
            from tokenmill.cluster.ray_launcher import RayRouter

            return RayRouter(
                config.engine, n, settings, f.ray_address, f.ray_cpus_per_worker, f.ray_worker_host, roles
            )
        # A fleet the planner scales is a router even while it has one worker; each worker gets its share
        # of the cores at the most workers the planner may run.
        launchers = [
            LocalEngineLauncher(with_role(worker_config(config.engine, i, hi), roles[i])) for i in range(n)
        ]
        return LaunchingRouter(launchers, [], settings)
    if hi != lo:
        raise ValueError("--workers MIN..MAX needs --planner load|sla")
    if f.scale_to_zero_after_s is not None:
        raise ValueError("--scale-to-zero-after needs --planner load|sla and --workers 0..MAX")
    discovery = None
    if f.discovery is not None:
        if not f.discovery_target:
            raise ValueError("--discovery needs --discovery-target (a file, DNS name or Service name)")
        discovery = make_discovery(f.discovery, f.discovery_target, f.discovery_port)
    if n < 0 or (n == 0 and not urls and discovery is None):
        raise ValueError("--workers must be at least 1 (or 0 with --worker-url or --discovery)")
    settings = router_settings(config)
    roles: list[str | None] = [None] * max(n, 0)
    if f.disaggregate:
        settings.disagg = disagg_settings(config)
        num_p, num_d = settings.disagg.num_prefill, settings.disagg.num_decode
        if n != num_p + num_d or urls or discovery is not None:
            raise ValueError(
                f"--disaggregate {f.disaggregate} needs --workers {num_p + num_d} started here "
                "(no --worker-url or --discovery)"
            )
        roles = list(settings.disagg.roles())
    if f.launcher == "ray":
        if urls:
            raise ValueError("--launcher ray starts its own workers: leave out --worker-url")
        from tokenmill.cluster.ray_launcher import RayRouter

        return RayRouter(
            config.engine, n, settings, f.ray_address, f.ray_cpus_per_worker, f.ray_worker_host, roles
        )
    if f.launcher != "local":
        raise ValueError(f"unknown launcher {f.launcher!r}; available: local, ray")
    # --worker-url or --discovery alone: no engine of our own
    local = 0 if (urls or discovery) and n == 1 else n
    if local == 1 and not urls and discovery is None:
        return MPEngineClient(config.engine)
    if local == 0 and len(urls) == 1 and discovery is None:
        return ZmqEngineClient(urls[0])
    launchers = [
        LocalEngineLauncher(
            with_role(worker_config(config.engine, i, local), roles[i] if i < len(roles) else None)
        )
        for i in range(local)
    ]
    return LaunchingRouter(launchers, urls, settings, discovery, f.discovery_interval_s)


def router_settings(config: ServerConfig) -> RouterSettings:
    """The router's settings from the fleet's flags, with its queue's order from the engine's policy."""
    f, sched = config.fleet, config.engine.scheduler
    settings = RouterSettings(f.router, f.router_temperature, f.router_prefill_weight, f.router_approx_ttl_s)
    if f.router_queue not in ("auto", "on", "off"):
        raise ValueError(f'--router-queue must be "auto", "on" or "off", got {f.router_queue!r}')
    settings.queue = f.router_queue == "on" or (
        f.router_queue == "auto" and sched.policy in ("priority", "fair")
    )
    if settings.queue:
        from tokenmill.engine.fairness import parse_tenant_weights

        settings.queue_fair = sched.policy == "fair"
        settings.queue_max_in_flight = sched.max_num_seqs
        settings.tenant_weights = parse_tenant_weights(sched.tenant_weights)
        settings.fair_input_weight, settings.fair_output_weight = (
            sched.fair_input_weight,
            sched.fair_output_weight,
        )
    return settings


def check_scale_to_zero(config: ServerConfig) -> None:
    """The scale-to-zero options make sense only for a planner's local fleet of MIN 0."""
    f, (_, lo, _) = config.fleet, config.worker_range
    if lo > 0:
        if f.scale_to_zero_after_s is not None:
            raise ValueError("--scale-to-zero-after needs --workers 0..MAX (a fleet that may have no worker)")
        return
    if f.disaggregate:
        raise ValueError("--workers 0..MAX cannot be used with --disaggregate (each pool keeps a worker)")
    if f.launcher != "local" or f.planner_prometheus_url:
        raise ValueError(
            "--workers 0..MAX (scale to zero) needs --launcher local and the fleet's own signals "
            "(no --planner-prometheus-url)"
        )
    if f.scale_to_zero_after_s is not None and f.scale_to_zero_after_s <= 0:
        raise ValueError(f"--scale-to-zero-after must be positive, got {f.scale_to_zero_after_s:g}")
    if f.cold_start_timeout_s <= 0 or f.cold_start_max_waiting < 1:
        raise ValueError("--cold-start-timeout must be positive and --cold-start-max-waiting at least 1")


def disagg_settings(config: ServerConfig) -> DisaggSettings:
    f = config.fleet
    num_p, num_d = parse_disaggregate(f.disaggregate or "")
    return DisaggSettings(
        num_p, num_d, f.disagg_min_prefill_tokens, f.disagg_max_prefill_inflight, f.disagg_prefill_timeout_s
    )


def worker_config(engine: EngineConfig, index: int, count: int) -> EngineConfig:
    """One local worker's config: its share of the cores, KV events on ipc:// beside its engine socket
    (the address is filled in by the launcher's folder)."""
    cores = os.cpu_count() or 1
    threads = engine.num_threads or max(1, cores // count)
    return dataclasses.replace(engine, num_threads=threads, seed=engine.seed + index)


def _events_beside(launcher: LocalEngineLauncher) -> None:
    """KV events on ipc:// sockets in the launcher's own folder."""
    folder = Path(launcher.address.removeprefix("ipc://")).parent
    ev = dataclasses.replace(
        launcher.config.kv_events,
        enable_kv_events=True,
        kv_events_endpoint=f"ipc://{folder / 'kv-events'}",
        kv_events_replay_endpoint=f"ipc://{folder / 'kv-replay'}",
    )
    launcher.config = dataclasses.replace(launcher.config, kv_events=ev)


def with_role(engine: EngineConfig, role: str | None) -> EngineConfig:
    """A worker's config with its part in a disaggregated fleet (None: it prefills and decodes alone)."""
    if role is None:
        return engine
    return dataclasses.replace(engine, kv_transfer=dataclasses.replace(engine.kv_transfer, kv_role=role))


class LaunchingRouter(RouterEngineClient):
    """A router that also starts (and restarts) the workers it was given as launchers."""

    def __init__(
        self,
        launchers: list[LocalEngineLauncher],
        urls: list[str],
        settings: RouterSettings,
        discovery: Discovery | None = None,
        discovery_interval_s: float = 5.0,
    ) -> None:
        for launcher in launchers:
            _events_beside(launcher)
        self.launchers = {launcher.address: launcher for launcher in launchers}
        # New workers (the planner's) are started like the first one.
        self.template = launchers[0].config if launchers else None
        self._launched = len(launchers)
        self.restarts = 0
        names = [f"local-{i}" for i in range(len(launchers))] + list(urls)
        super().__init__(
            [*self.launchers, *urls],
            settings,
            names=names,
            discovery=discovery,
            discovery_interval_s=discovery_interval_s,
        )
        for w in self.workers:
            if w.url in self.launchers:
                w.role = self.launchers[w.url].config.kv_transfer.kv_role

    async def start(self) -> None:
        for launcher in self.launchers.values():
            launcher.start()
        await super().start()

    def _client_for(self, w: Worker, timeout: float) -> ZmqEngineClient:
        launcher = self.launchers.get(w.url)
        if launcher is None:
            return super()._client_for(w, timeout)
        if launcher.exit_reason() is not None:  # it died: start it again before rejoining it
            launcher.start()
            self.restarts += 1
        return ZmqEngineClient(w.url, timeout, self.heartbeat_timeout, launcher=launcher)

    async def add_worker(self, role: str | None = None) -> Worker:
        """Launch one more local worker (of a role, in a disaggregated fleet); it serves once it has
        loaded and joined."""
        if self.template is None:
            raise RuntimeError("this fleet launched no workers here: it cannot start more")
        config = dataclasses.replace(self.template, seed=self.template.seed + self._launched)
        launcher = LocalEngineLauncher(with_role(config, role) if role is not None else config)
        _events_beside(launcher)
        launcher.start()
        self.launchers[launcher.address] = launcher
        free = next((w.slot for w in self.workers if w.retired), len(self.workers))
        w = Worker(free, launcher.address, f"local-{self._launched}", role=role)
        self._launched += 1
        if free == len(self.workers):
            self.workers.append(w)
        else:
            self.workers[free] = w
        log.info("planner: launched worker %s (slot %d)", w.name, w.slot)
        self.join_new(w)
        return w

    async def remove_worker(self, w: Worker, drain_timeout_s: float = 600.0) -> None:
        """Drain a worker, then stop its process (a worker attached by address is only dropped)."""
        await self.drain(w, drain_timeout_s)
        launcher = self.launchers.pop(w.url, None)
        if launcher is not None:
            await launcher.stop(30.0)  # its engine writes its KV to any offload file tiers as it stops
        log.info("planner: removed worker %s", w.name)

    async def shutdown(self) -> None:
        await super().shutdown()
        for launcher in self.launchers.values():
            await launcher.stop(5.0)
