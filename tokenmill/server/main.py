"""Run the server: start the engine process, then uvicorn; drain on SIGTERM."""

from __future__ import annotations

import asyncio
import contextlib
import errno
import logging
import signal
import socket
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from types import FrameType
from typing import Any

import uvicorn

from tokenmill.engine.client import EngineClient, EngineDeadError
from tokenmill.extras import require
from tokenmill.frontend.async_llm import AsyncLLM
from tokenmill.server.app import build_app
from tokenmill.server.config import ServerConfig

log = logging.getLogger("tokenmill.server")
DEFAULT_SCALE_TO_ZERO_AFTER_S = 300.0


def start_planner(config: ServerConfig, llm: AsyncLLM, metrics: Any) -> Any:  # noqa: ANN401
    """The planner loop over this server's fleet (--planner load|sla), its metrics on /metrics."""
    from tokenmill.cluster.planner.connectors import FleetConnector
    from tokenmill.cluster.planner.loop import PlannerLoop, Pool
    from tokenmill.cluster.planner.policy import Planner, PlannerConfig

    f = config.fleet
    _, lo, hi = config.worker_range

    def pool(name: str, lo: int, hi: int, rps: float | None) -> Pool:
        pc = PlannerConfig(
            mode=f.planner,  # type: ignore[arg-type]
            min_workers=max(lo, 1),
            max_workers=max(hi, lo, 1),
            interval_s=f.planner_interval_s,
            up_cooldown_s=f.planner_up_cooldown_s,
            down_cooldown_s=f.planner_down_cooldown_s,
            ttft_target_s=f.planner_ttft_target_s,
            itl_target_s=f.planner_itl_target_s,
            surge=f.planner_surge,
        )
        planner = Planner(pc, (lambda isl, osl: rps) if rps else None)
        connector = FleetConnector(llm.client, f.planner_drain_timeout_s, None if name == "all" else name)
        return Pool(name, planner, connector)

    if f.disaggregate:
        # Each pool keeps one worker at least (decode takes the rest of the fleet's floor); the most
        # either may have is what the other leaves of the fleet's bound, reset at every decision.
        pools = [
            pool("prefill", 1, hi - 1, f.planner_prefill_capacity_rps),
            pool("decode", max(lo - 1, 1), hi - 1, f.planner_capacity_rps),
        ]
    else:
        pools = [pool("all", lo, hi, f.planner_capacity_rps)]
    prometheus = None
    if f.planner_prometheus_url:
        from tokenmill.cluster.planner.prometheus import PrometheusSignals

        prometheus = PrometheusSignals(f.planner_prometheus_url, config.model_name, f.planner_window_s)
    # --workers 0..MAX: the loop itself stops the last worker after this long idle (the policy keeps
    # at least one), and starts one at once for a request that finds none.
    idle = (f.scale_to_zero_after_s or DEFAULT_SCALE_TO_ZERO_AFTER_S) if lo == 0 else None
    loop = PlannerLoop(
        pools, llm.client, metrics, f.planner_window_s, config.model_name, prometheus, hi, idle
    )
    metrics.registry.register(loop)
    loop.start()
    return loop


async def serve(config: ServerConfig, announce: bool = True) -> None:
    from tokenmill.cluster.fleet import engine_client_for

    if config.model_repository:  # said now, not once the engine has loaded (minutes, for a big model)
        require("triton", "serve --model-repository")
    if config.engine.otlp_traces_endpoint:
        require("tracing", "serve --otlp-traces-endpoint")
    client = engine_client_for(config)  # the fleet's settings checked before anything starts
    # The ports are taken before the engine loads (minutes, for a big model): one already in use is
    # said at once, not after the load. Connections made meanwhile wait in the backlog.
    http_sock = listen_socket(config.host, config.port, "--port")
    grpc_hold = None
    if config.model_repository and config.grpc_port:
        grpc_hold = bind_socket(config.host, config.grpc_port, "--grpc-port (0: no gRPC)")
    try:
        await _serve(config, client, http_sock, grpc_hold, announce)
    finally:
        http_sock.close()
        if grpc_hold is not None:
            grpc_hold.close()


async def _serve(
    config: ServerConfig,
    client: EngineClient,
    http_sock: socket.socket,
    grpc_hold: socket.socket | None,
    announce: bool,
) -> None:
    note = asyncio.create_task(_say_loading(config, http_sock)) if announce else None
    try:
        llm = await AsyncLLM.start(config.engine, client=client)
    finally:
        if note is not None:
            note.cancel()
    repo = None
    if config.model_repository:
        from tokenmill.triton.repository import ModelRepository
        from tokenmill.triton.response_cache import ResponseCache, parse_cache_config

        cache_size = parse_cache_config(config.cache_config)
        repo = ModelRepository(
            Path(config.model_repository),
            config.model_control_mode,
            config.load_models,
            config.repository_poll_secs,
            config.model_memory_budget_mb,
            cache=ResponseCache(cache_size) if cache_size else None,
        )
        repo.add_llm(config.model_name, llm)  # the LLM in the repository: generate, streaming, ensembles
    app = build_app(llm, config, repo)
    planner = start_planner(config, llm, app.state.tm.metrics) if config.fleet.planner else None
    app.state.tm.planner = planner
    server = _Server(
        uvicorn.Config(
            app,
            host=config.host,
            port=config.port,
            log_level="warning",
            timeout_graceful_shutdown=int(config.drain_timeout_s),
            lifespan="off",
        )
    )
    server.on_signal = lambda: setattr(app.state.tm, "draining", True)
    server.cut_off = lambda: llm.cut_off(EngineDeadError("the server is shutting down"))
    server.busy = lambda: app.state.tm.admission.sequences > 0
    server.drain_timeout_s = config.drain_timeout_s
    if announce:
        # Said once uvicorn serves on the socket: not before, when the server could still fail to start.
        server.on_started = lambda: _announce(config, llm, http_sock.getsockname()[1])
    grpc_server = None
    try:
        if repo is not None:
            await repo.start()
            if grpc_hold is not None:
                from tokenmill.triton.grpc_front import start_grpc

                grpc_hold.close()  # held against others until now: gRPC binds the port itself
                grpc_server = await start_grpc(repo, config.host, config.grpc_port, config.api_key)
        await server.serve(sockets=[http_sock])
    finally:
        if planner is not None:
            await planner.stop()
        if grpc_server is not None:
            await grpc_server.stop(grace=config.drain_timeout_s)
        if repo is not None:
            await repo.close()
        await llm.shutdown()


async def _say_loading(config: ServerConfig, sock: socket.socket, after_s: float = 3.0) -> None:
    """A load that takes more than a few seconds (a first start caches weights and builds the kernels, a
    big model takes minutes) says what is going on, rather than nothing until the banner."""
    await asyncio.sleep(after_s)
    where = f"{config.host}:{sock.getsockname()[1]}"
    print(
        f"tokenmill: loading {config.model_name!r}; serving on {where} once it is ready",
        file=sys.stderr,
        flush=True,
    )


def _announce(config: ServerConfig, llm: AsyncLLM, port: int) -> None:
    base = f"http://{config.host}:{port}"
    # (a named key is not printed: the name is the tenant's, the key theirs)
    key = config.api_key.split(",")[0] if config.api_key else ("KEY" if config.named_api_key else "none")
    print(
        f"tokenmill serving {config.model_name!r} on {base} "
        f"(max_model_len {llm.max_model_len}, engine loaded in {llm.client.info['load_seconds']:.2f}s)\n"
        f"  curl {base}/v1/chat/completions -H 'Content-Type: application/json' "
        f"""-d '{{"model": "{config.model_name}", "messages": """
        f"""[{{"role": "user", "content": "Hello!"}}]}}'\n"""
        f"  OpenAI client: OpenAI(base_url='{base}/v1', api_key='{key}')\n"
        f"  console: {base}/ui",
        file=sys.stderr,
        flush=True,
    )


class PortError(ValueError):
    """A port the server cannot take: in use, not allowed, or an address this host does not have."""


def _socket_for(host: str, port: int) -> socket.socket:
    # A literal IPv6 address takes an IPv6 socket (as uvicorn picks); names and IPv4 addresses IPv4.
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
    # A port whose last connections are still in TIME_WAIT (a server just restarted) is free to take.
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    return sock


def bind_socket(host: str, port: int, flag: str) -> socket.socket:
    """A TCP socket bound to (host, port), not listening; PortError with a one-line reason if it cannot be."""
    sock = _socket_for(host, port)
    try:
        sock.bind((host, port))
    except OSError as e:
        sock.close()
        if e.errno == errno.EADDRINUSE:
            raise PortError(f"port {port} on {host} is in use: pick another with {flag}") from None
        raise PortError(f"cannot listen on {host}:{port}: {e.strerror or e}") from None
    return sock


def listen_socket(host: str, port: int, flag: str) -> socket.socket:
    """bind_socket, listening: the port is this server's from now on (uvicorn serves on the socket)."""
    sock = bind_socket(host, port, flag)
    # Connections accepted from it inherit TCP_NODELAY (Linux): a response goes out as uvicorn writes it.
    # Without it, Nagle held a body written after its headers until the client's delayed ACK: 40 ms on
    # every keep-alive request after the first few (a console polling, a load balancer's probes).
    with contextlib.suppress(OSError):  # not TCP (a test's stand-in): nothing to set
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    sock.listen(2048)  # uvicorn's own backlog
    return sock


class _Server(uvicorn.Server):
    """uvicorn, except that a SIGTERM/SIGINT ends in a clean exit after the drain.

    uvicorn re-raises the signal once it has stopped, which would kill this process before it can
    shut the engine process down.
    """

    on_signal: Callable[[], None] | None = None
    cut_off: Callable[[], object] | None = None  # ends the requests in flight with an error answer
    on_started: Callable[[], None] | None = None  # once it serves on its sockets
    busy: Callable[[], bool] = staticmethod(lambda: False)  # work in flight?
    drain_timeout_s: float = 30.0
    _draining: bool = False

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        # First signal: readiness turns false and new requests get 503 + Retry-After, while the
        # socket stays open (a load balancer sees a 503, not a refused connection) until in-flight
        # requests finish or the drain timeout passes. A second signal exits at once.
        if self._draining:
            asyncio.get_running_loop().call_soon(self._stop_now)  # on the loop, not inside the handler
            return
        if self.on_signal is None:
            super().handle_exit(sig, frame)
            return
        self._draining = True
        self.on_signal()
        loop = asyncio.get_running_loop()
        loop.call_soon(lambda: loop.create_task(self._drain_then_exit(sig, frame)))

    async def _drain_then_exit(self, sig: int, frame: FrameType | None) -> None:
        deadline = time.monotonic() + self.drain_timeout_s
        while self.busy() and time.monotonic() < deadline and not self.should_exit:
            await asyncio.sleep(0.05)
        if not self.should_exit:  # (a second signal has stopped the server already)
            self._stop_now()

    def _stop_now(self) -> None:
        """Exit without waiting for requests: those still running get an error answer first.

        uvicorn, told to exit, waits for open requests once more (another drain timeout), and past it
        cancels them, which logs a traceback per request and drops its connection.
        """
        if self.cut_off is not None:
            self.cut_off()
        self.should_exit = True

    async def startup(self, sockets: list[socket.socket] | None = None) -> None:
        await super().startup(sockets)
        if self.started and self.on_started is not None:
            self.on_started()

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        if threading.current_thread() is not threading.main_thread():
            yield
            return
        original = {sig: signal.signal(sig, self.handle_exit) for sig in (signal.SIGINT, signal.SIGTERM)}
        try:
            yield
        finally:
            for sig, handler in original.items():
                signal.signal(sig, handler)


def run(config: ServerConfig) -> None:
    asyncio.run(serve(config))
