"""The router: one EngineClient over a fleet of engine workers, so the OpenAI and KServe fronts serve a
fleet unchanged.

Each request goes to the worker a policy picks (cluster/policies.py); `kv` weighs how much of the
request's prompt each worker already holds, from the index its KV events keep (cluster/kv_index.py),
against the load the router has put on it. Workers come and go: one whose connection drops, whose
process exits, or who stops answering leaves rotation; requests of a lost worker that have not yet
produced a token are sent to another worker, streams already under way end with an error; a worker
that answers again rejoins with its index rebuilt from its events.

Every request ends, answered or with an error, within stated bounds of silence: a retry goes only to a
worker heard from within SUSPECT_AFTER_S (one that has proven it answers), waiting at most
RouterSettings.retry_wait_s for one; a request whose worker sends nothing (no output, no heartbeat) for
RouterSettings.lost_after_s after it was sent is taken as lost (retried if it has no token yet, else
ended with an error), well before the client's own heartbeat timeout.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import dataclasses
import itertools
import logging
import time
from collections import Counter, OrderedDict
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlparse

import zmq
import zmq.asyncio
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from tokenmill import tracing
from tokenmill.cluster.approx_index import ApproxKVIndex
from tokenmill.cluster.disagg import DisaggSettings
from tokenmill.cluster.discovery import Discovery
from tokenmill.cluster.kv_index import KVIndex
from tokenmill.cluster.kv_subscriber import KVEventSubscriber
from tokenmill.cluster.policies import Candidate, Picker, kv_costs
from tokenmill.cluster.prefix_hasher import PrefixHasher
from tokenmill.engine.client import (
    EngineClient,
    EngineDeadError,
    ZmqEngineClient,
    destroy_context,
    new_context,
)
from tokenmill.engine.protocol import EngineCoreOutput, EngineRequest, EngineStats, FinishReason
from tokenmill.lora.request import kv_salt

log = logging.getLogger(__name__)
# A worker silent this long gets no new requests: four missed heartbeats (engines beat every 0.5 s,
# during steps too), so a loaded machine's scheduling jitter does not take idle workers out of rotation.
SUSPECT_AFTER_S = 2.0
REJOIN_EVERY_S = 1.0
MAX_RETRIES = 2
RETRY_POLL_S = 0.1  # how often a retry waiting for a worker that answers looks again


@dataclass
class RouterSettings:
    policy: str = "kv"
    temperature: float = 0.0
    prefill_weight: float = 1.0
    approx_ttl_s: float = 120.0
    seed: int = 0
    disagg: DisaggSettings | None = None  # prefill/decode disaggregation (cluster/disagg.py)
    # A retry goes only to a worker answering now (heard from within SUSPECT_AFTER_S); with none, it
    # waits this long for one, then the request ends with EngineDeadError (the server's 503).
    retry_wait_s: float = 10.0
    # A request whose worker has sent nothing (no output, no heartbeat: engines beat every half second, during
    # steps too) for this long since the request was sent is lost: retried if it has no token yet, else
    # ended with EngineDeadError, rather than waiting for the client's heartbeat timeout (40 s).
    lost_after_s: float = 10.0


@dataclass
class _Active:
    prefill_blocks: int  # uncached blocks still to prefill (until the first token)
    blocks: int
    started: bool = False


@dataclass
class Worker:
    slot: int
    url: str
    name: str = ""  # its label in metrics (the url, or local-N for a worker launched here)
    client: ZmqEngineClient | None = None
    subscriber: KVEventSubscriber | None = None
    up: bool = False
    joining: bool = False
    last_attempt: float = 0.0
    info: dict[str, Any] = field(default_factory=dict)
    active: dict[str, _Active] = field(default_factory=dict)
    joins: int = 0
    last_error: str | None = None  # why its last attempt to join failed
    discovered: bool = False  # found by discovery (and so dropped when discovery loses it)
    retired: bool = False  # dropped from the fleet; its slot may be taken by a new worker
    draining: bool = False  # gets no new requests: it finishes what it has, then leaves (the planner)
    role: str | None = None  # its part in a disaggregated fleet, as launched (known before it joins)
    launched_at: float = field(default_factory=time.monotonic)
    # Running sums over `active` (kept, not recomputed: a decision must not cost O(requests)).
    prefill_blocks: int = 0  # uncached prompt blocks of requests without a token yet
    decode_blocks: int = 0  # blocks of requests that are generating

    def add_active(self, rid: str, a: _Active) -> None:
        self.active[rid] = a
        self.prefill_blocks += a.prefill_blocks

    def start_active(self, rid: str) -> None:
        a = self.active.get(rid)
        if a is not None and not a.started:
            a.started = True
            self.prefill_blocks -= a.prefill_blocks
            self.decode_blocks += a.blocks

    def drop_active(self, rid: str) -> None:
        a = self.active.pop(rid, None)
        if a is not None:
            if a.started:
                self.decode_blocks -= a.blocks
            else:
                self.prefill_blocks -= a.prefill_blocks

    def clear_active(self) -> None:
        self.active.clear()
        self.prefill_blocks = self.decode_blocks = 0

    def answering(self, now: float) -> bool:
        """Gets new requests: up, connected, not known dead (the supervisor drops dead ones within
        0.1 s, but a retry may look sooner) and heard from within SUSPECT_AFTER_S."""
        c = self.client
        return self.up and c is not None and c.dead_reason is None and now - c.last_heard < SUSPECT_AFTER_S


@dataclass
class RouterStats:
    decisions: Counter = field(default_factory=Counter)  # by policy
    overlap_blocks: int = 0  # prompt blocks credited as already held by the chosen worker
    request_blocks: int = 0
    retries: int = 0
    worker_losses: int = 0
    disaggregated: int = 0  # requests whose prompt a prefill worker computed
    disagg_fallbacks: int = 0  # ... that was tried and failed: the decode worker computed it


class _Relay:
    """Stands in for the caller's queue at a worker's client: sees each output (or error) first."""

    __slots__ = (
        "router", "req", "queue", "slot", "started", "tries", "hashes", "sent_at", "failed", "wait_until",
    )  # fmt: skip

    def __init__(self, router: RouterEngineClient, req: EngineRequest, queue: asyncio.Queue) -> None:
        self.router, self.req, self.queue = router, req, queue
        self.slot = -1
        self.started = False
        self.tries = 0
        self.hashes: list[int] | None = None
        self.sent_at = 0.0  # time.monotonic() of the last dispatch
        self.failed: set[tuple[int, int]] = set()  # (slot, joins) of the workers it was lost on
        self.wait_until: float | None = None  # a retry waiting for a worker that answers: until then

    def put_nowait(self, item: object) -> None:
        r = self.router
        if isinstance(item, EngineCoreOutput):
            if not self.started and item.new_token_ids:
                self.started = True
                r._started(self)
            if item.finish_reason is not None:
                r._release(self)
        elif isinstance(item, EngineDeadError) and not self.started and self.tries <= MAX_RETRIES:
            w = r.workers[self.slot]
            w.drop_active(self.req.request_id)  # stays findable for abort
            self.failed.add((w.slot, w.joins))  # not sent there again (but after it rejoins)
            self.wait_until = None
            r.stats_router.retries += 1
            asyncio.get_running_loop().call_soon(r._redispatch, self)
            return
        elif isinstance(item, Exception):
            r._release(self)
        self.queue.put_nowait(item)


class RouterEngineClient(EngineClient):
    def __init__(
        self,
        urls: list[str],
        settings: RouterSettings | None = None,
        startup_timeout: float = 600.0,
        heartbeat_timeout: float | None = None,  # None: default_heartbeat_timeout()
        names: list[str] | None = None,
        discovery: Discovery | None = None,
        discovery_interval_s: float = 5.0,
    ) -> None:
        if not urls and discovery is None:
            raise ValueError("the router needs at least one worker, or a way to discover them")
        self.discovery, self.discovery_interval_s = discovery, discovery_interval_s
        self._last_discovery = 0.0
        self.settings = s = settings or RouterSettings()
        self.picker = Picker(s.policy, s.temperature, s.prefill_weight, s.seed)
        self.workers = [Worker(i, u, names[i] if names else u) for i, u in enumerate(urls)]
        self.index = KVIndex()
        self.approx = ApproxKVIndex(s.approx_ttl_s) if s.policy == "kv-approx" else None
        self.stats_router = RouterStats()
        self.startup_timeout, self.heartbeat_timeout = startup_timeout, heartbeat_timeout
        self.info = {}
        self.block_size = 0
        self._where: dict[str, _Relay] = {}
        self._joins: set[asyncio.Task] = set()
        # (time, prompt tokens) of recent requests: the arrival rate the planner forecasts from.
        self.arrivals: collections.deque[tuple[float, int]] = collections.deque(maxlen=200_000)
        # Requests whose prompt a prefill worker is computing -> that prefill's relay (None: not sent yet).
        self._pd_phase: dict[str, _Relay | None] = {}
        self._siblings: OrderedDict[str, int] = OrderedDict()  # parent request id -> slot (n > 1)
        # Where recent requests went, and the blocks credited there (for logs, tests and debugging).
        self.placements: OrderedDict[str, tuple[int, int]] = OrderedDict()
        self._hasher: PrefixHasher | None = None
        self._ctx: zmq.asyncio.Context | None = None
        self._task: asyncio.Task | None = None

    @property
    def stats(self) -> EngineStats | None:  # type: ignore[override]
        """The fleet's stats: counts summed, KV usage averaged over the workers that are up."""
        got = list(self.worker_stats().values())
        if not got:
            return None
        return EngineStats(
            num_running=sum(s.num_running for s in got),
            num_waiting=sum(s.num_waiting for s in got),
            kv_cache_usage=sum(s.kv_cache_usage for s in got) / len(got),
            num_blocks=sum(s.num_blocks for s in got),
            prefix_cache_queries=sum(s.prefix_cache_queries for s in got),
            prefix_cache_hits=sum(s.prefix_cache_hits for s in got),
            num_preemptions=sum(s.num_preemptions for s in got),
            num_steps=sum(s.num_steps for s in got),
            num_batched_tokens_total=sum(s.num_batched_tokens_total for s in got),
            spec_num_drafts=sum(s.spec_num_drafts for s in got),
            spec_num_draft_tokens=sum(s.spec_num_draft_tokens for s in got),
            spec_num_accepted_tokens=sum(s.spec_num_accepted_tokens for s in got),
            spec_accepted_per_pos=[
                sum(col)
                for col in itertools.zip_longest(*(s.spec_accepted_per_pos for s in got), fillvalue=0)
            ],
            kv_connector=dict(sum((collections.Counter(s.kv_connector) for s in got), collections.Counter())),
        )

    def set_policy(self, policy: str) -> None:
        """Route by another policy from now on (kv-approx's own index only exists if started with it)."""
        if policy == "kv-approx" and self.approx is None:
            raise ValueError("kv-approx must be chosen when the router starts")
        self.picker = Picker(
            policy, self.settings.temperature, self.settings.prefill_weight, self.settings.seed
        )
        self.settings.policy = policy

    # -- scaling (the planner) ------------------------------------------------------------------------
    def fleet_counts(self, pool: str | None = None) -> tuple[int, int, int]:
        """Workers (serving, starting, draining): those that take requests, those launched that do not
        yet, and those finishing their requests before they stop; of one pool of a disaggregated fleet
        ("prefill" or "decode") when `pool` is given."""
        live = [w for w in self.workers if not w.retired and in_pool(w, pool)]
        serving = sum(1 for w in live if w.up and not w.draining)
        starting = sum(1 for w in live if not w.up and not w.draining)
        return serving, starting, sum(1 for w in live if w.draining)

    def join_new(self, w: Worker) -> None:
        """Join a worker just launched, allowing it the whole start-up time (a rejoin allows 5 s)."""
        w.joining, w.last_attempt = True, time.monotonic()
        task = asyncio.get_running_loop().create_task(self._join(w, self.startup_timeout))
        self._joins.add(task)
        task.add_done_callback(self._joins.discard)

    async def drain(self, w: Worker, timeout_s: float = 600.0) -> None:
        """Take a worker out of rotation, let its requests finish (or time out), then drop it."""
        w.draining = True
        deadline = time.monotonic() + timeout_s
        while w.active and w.up and time.monotonic() < deadline:
            await asyncio.sleep(0.1)
        if w.active:
            log.warning(
                "worker %s still had %d requests after draining %.0fs", w.name, len(w.active), timeout_s
            )
        w.retired = True
        if w.up:
            await self._leave(w, "drained (scaled down)")
            self.stats_router.worker_losses -= 1  # a planned departure, not a loss
        if w.subscriber is not None:
            await w.subscriber.stop()
            w.subscriber = None

    def worker_stats(self) -> dict[str, EngineStats]:
        return {w.name: w.client.stats for w in self.workers if w.up and w.client and w.client.stats}

    def router_metrics(self, model: str) -> Iterator[Metric]:
        """Prometheus families of the router's own (decisions, overlap credited, retries, workers)."""
        st = self.stats_router
        d = CounterMetricFamily(
            "tokenmill:router_decisions", "Routing decisions, by policy", labels=["model_name", "policy"]
        )
        for policy, n in sorted(st.decisions.items()):
            d.add_metric([model, policy], n)
        yield d
        for name, doc, value, kind in (
            ("router_overlap_blocks", "Prompt blocks the chosen worker already held", st.overlap_blocks, 0),
            ("router_request_blocks", "Prompt blocks routed", st.request_blocks, 0),
            ("router_retries", "Requests sent again after their worker was lost", st.retries, 0),
            ("router_worker_losses", "Times a worker left rotation", st.worker_losses, 0),
            ("router_disaggregated", "Requests prefilled on a prefill worker", st.disaggregated, 0),
            (
                "router_disagg_fallbacks",
                "Remote prefills that failed (computed locally)",
                st.disagg_fallbacks,
                0,
            ),
            ("router_workers_up", "Workers in rotation", self.num_up, 1),
            ("router_workers_answering", "Workers heard from within the last second", self.num_answering, 1),
            ("router_indexed_blocks", "Distinct KV blocks in the router's index", len(self.index), 1),
        ):
            fam = (CounterMetricFamily if kind == 0 else GaugeMetricFamily)(
                f"tokenmill:{name}", doc, labels=["model_name"]
            )
            fam.add_metric([model], value)
            yield fam
        # Which worker is down (the counts above say only how many): one series per worker of the fleet,
        # with its role in a disaggregated one.
        up = GaugeMetricFamily(
            "tokenmill:router_worker_up",
            "1 while the worker is in rotation, 0 while it is down, draining or joining",
            labels=["model_name", "worker", "role"],
        )
        for w in self.workers:
            if not w.retired:
                up.add_metric([model, w.name, w.role or ""], 1.0 if w.up and not w.draining else 0.0)
        yield up
        ev = CounterMetricFamily(
            "tokenmill:router_kv_event_gaps",
            "Gaps in a worker's KV-event stream, by outcome",
            labels=["model_name", "worker", "outcome"],
        )
        for w in self.workers:
            if w.subscriber is not None:
                sst = w.subscriber.stats
                ev.add_metric([model, w.name, "seen"], sst.gaps)
                ev.add_metric([model, w.name, "lost"], sst.lost)
        yield ev

    # -- membership ---------------------------------------------------------------------------
    async def start(self) -> None:
        self._ctx = new_context()
        if self.discovery is not None:
            await self._discover()
        deadline = time.monotonic() + self.startup_timeout
        while True:
            pending = [w for w in self.workers if not w.retired]
            left = max(1.0, deadline - time.monotonic())
            # Failures are said once the round is over: each worker's warning where others came up,
            # else the reasons in the one error (every worker of a bad model file fails alike).
            await asyncio.gather(*(self._join(w, left, report=False) for w in pending))
            if any(w.up for w in self.workers):
                for w in pending:
                    if not w.up and w.last_error is not None:
                        log.warning("worker %s is not up: %s", w.url, w.last_error)
                break
            if self.discovery is None or time.monotonic() > deadline:
                reasons = sorted({w.last_error for w in pending if w.last_error is not None})
                raise EngineDeadError(
                    f"no worker answered ({', '.join(w.url for w in pending) or 'none found'})"
                    + (f": {'; '.join(reasons)}" if reasons else "")
                )
            await asyncio.sleep(self.discovery_interval_s)  # none found or ready yet: look again
            await self._discover()
        self._task = asyncio.create_task(self._supervise())

    async def _discover(self) -> None:
        """Make the discovered part of the fleet match what discovery says now."""
        assert self.discovery is not None
        self._last_discovery = time.monotonic()
        try:
            found = await asyncio.to_thread(self.discovery.addresses)
        except Exception as e:  # noqa: BLE001 - a failed look-up changes nothing; try again later
            log.warning("worker discovery failed: %s", e)
            return
        current = {w.url: w for w in self.workers if not w.retired}
        for url, w in current.items():
            if w.discovered and url not in found:
                if w.up:
                    await self._leave(w, "no longer discovered")
                w.retired = True
        for url in sorted(found - current.keys()):
            free = next((w.slot for w in self.workers if w.retired), len(self.workers))
            w = Worker(free, url, url, discovered=True)
            if free == len(self.workers):
                self.workers.append(w)
            else:
                self.workers[free] = w
            log.info("discovered worker %s (slot %d)", url, free)

    def _client_for(self, w: Worker, timeout: float) -> ZmqEngineClient:
        """A client for a worker (a hook: launched workers also watch their process)."""
        return ZmqEngineClient(w.url, startup_timeout=timeout, heartbeat_timeout=self.heartbeat_timeout)

    async def _resolve(self, w: Worker) -> None:
        """Where the worker listens now (a hook: a launcher may move a restarted worker); raises
        EngineDeadError while it cannot say."""

    async def _join(self, w: Worker, timeout: float, report: bool = True) -> None:
        """Start a client for the worker and put it in rotation; on failure its reason is kept in
        `w.last_error` (and logged, with `report`)."""
        w.joining, w.last_attempt, w.last_error = True, time.monotonic(), None
        try:
            await self._resolve(w)
        except EngineDeadError as e:
            w.last_error = str(e)
            if report:
                log.warning("worker %s is not up: %s", w.name, e)
            w.joining = False
            return
        client = self._client_for(w, timeout)
        try:
            await client.start()
            info = client.info
            bs = int(info.get("block_size", 0))
            if self.block_size and bs != self.block_size:
                raise EngineDeadError(f"block size {bs} differs from the fleet's {self.block_size}")
            if self.info and info.get("model") != self.info.get("model"):
                raise EngineDeadError(f"serves {info.get('model')!r}, the fleet {self.info.get('model')!r}")
            self.index.remove_worker(w.slot)
            if self.approx is not None:
                self.approx.remove_worker(w.slot)
            ev = info.get("kv_events")
            if ev and self.settings.policy == "kv":
                assert self._ctx is not None
                w.subscriber = KVEventSubscriber(
                    self._ctx,
                    w.slot,
                    _reachable(ev["endpoint"], w.url),
                    _reachable(ev["replay_endpoint"], w.url) if ev.get("replay_endpoint") else None,
                    ev.get("topic", ""),
                    self.index,
                )
                w.subscriber.start()
                with contextlib.suppress(asyncio.TimeoutError):
                    await asyncio.wait_for(w.subscriber.synced.wait(), 5.0)
            elif self.settings.policy == "kv":
                log.warning("worker %s publishes no KV events: routed by load alone", w.url)
        except (EngineDeadError, OSError, zmq.ZMQError) as e:
            w.last_error = str(e)
            if report:
                log.warning("worker %s is not up: %s", w.url, e)
            client.fail(f"not joined: {e}")  # and so not told to shut down: it may be starting still
            await client.shutdown()
            w.joining = False
            return
        if not self.info:
            self.info = dict(info)
            self.block_size = int(info.get("block_size", 16))
        self.info["max_model_len"] = min(int(self.info["max_model_len"]), int(info["max_model_len"]))
        w.client, w.info, w.up, w.joining = client, info, True, False
        w.joins += 1
        self.info["workers"] = sum(x.up for x in self.workers)
        log.info("worker %s joined (slot %d)", w.url, w.slot)

    async def _leave(self, w: Worker, reason: str) -> None:
        log.warning("worker %s left rotation: %s", w.url, reason)
        w.up = False
        self.stats_router.worker_losses += 1
        self.index.remove_worker(w.slot)
        if self.approx is not None:
            self.approx.remove_worker(w.slot)
        if w.subscriber is not None:
            await w.subscriber.stop()
            w.subscriber = None
        if w.client is not None:
            # Its requests get EngineDeadError through their relays: retried, or ended with an error.
            if w.client.dead_reason is None:
                w.client.fail(f"worker {w.url} left: {reason}")
            await w.client.shutdown()
            w.client = None
        w.clear_active()
        self.info["workers"] = sum(x.up for x in self.workers)

    async def _supervise(self) -> None:
        while True:
            await asyncio.sleep(0.1)
            now = time.monotonic()
            if self.discovery is not None and now - self._last_discovery >= self.discovery_interval_s:
                await self._discover()
            for w in self.workers:
                if w.retired:
                    continue
                if w.up and w.client is not None and w.client.dead_reason is not None:
                    await self._leave(w, w.client.dead_reason)
                elif not w.up and not w.joining and now - w.last_attempt >= REJOIN_EVERY_S:
                    asyncio.create_task(self._join(w, startup_timeout_rejoin(self.startup_timeout)))
            self._find_lost(time.monotonic())

    def _find_lost(self, now: float) -> None:
        """Requests whose worker has sent nothing (no output, no heartbeat) for settings.lost_after_s
        since they were sent are lost: aborted there (should it speak again), then retried if they have
        no token yet, else ended with EngineDeadError; the worker gets no retries while it is silent."""
        bound = self.settings.lost_after_s
        for w in self.workers:
            c = w.client
            # (a client known dead has failed its requests already)
            if not w.active or c is None or c.dead_reason is not None or now - c.last_heard <= bound:
                continue
            lost = [
                relay
                for rid in w.active
                if (relay := self._where.get(rid)) is not None
                and relay.slot == w.slot
                and now - relay.sent_at > bound
            ]
            if not lost:
                continue
            why = f"no word from worker {w.name} for {now - c.last_heard:.0f}s (lost after {bound:g}s)"
            log.warning("%d requests on worker %s are lost: %s", len(lost), w.name, why)
            with contextlib.suppress(EngineDeadError, zmq.ZMQError):
                c.abort([relay.req.request_id for relay in lost])  # its late outputs go nowhere
            for relay in lost:
                relay.put_nowait(EngineDeadError(why))

    # -- requests -----------------------------------------------------------------------------
    def _hashes(self, relay: _Relay) -> list[int]:
        if relay.hashes is None:
            relay.hashes = self._hashes_of(relay.req.prompt_token_ids, _salt(relay.req))
        return relay.hashes

    def _hashes_of(self, prompt_ids: list[int], salt: str | None) -> list[int]:
        """The published names of a prompt's full blocks: the same chain the workers compute."""
        return self._hasher_for().hashes(prompt_ids, salt)

    def _hasher_for(self) -> PrefixHasher:
        if self._hasher is None or self._hasher.block_size != self.block_size:
            self._hasher = PrefixHasher(self.block_size)
        return self._hasher

    def _pick(self, relay: _Relay, exclude: set[int], role: str | None = None) -> tuple[Worker, int]:
        """The worker for a request (and the prompt blocks it holds). A retry goes only to a worker that
        answers now, and not again to one it was lost on (unless that worker has rejoined since)."""
        ups = [
            w
            for w in self.workers
            if w.up
            and not w.draining
            and w.slot not in exclude
            and _fits(w, role)
            and w.client is not None
            and w.client.dead_reason is None  # known dead: the supervisor is about to drop it
            and (w.slot, w.joins) not in relay.failed
        ]
        # A worker silent for a second gets no new requests; all of them silent: a long step, not death
        # (settings.lost_after_s bounds the wait). A retry never waits on one that has not proven it answers.
        now = time.monotonic()
        answering = [w for w in ups if w.answering(now)]
        if not answering and relay.tries == 0:
            answering = ups
        if not answering:
            raise EngineDeadError("no worker is up" if not ups else "no worker answers")
        req = relay.req
        parent = req.request_id.split("#", 1)[0]
        if role != "prefill" and parent != req.request_id and parent in self._siblings:
            slot = self._siblings[parent]
            for w in answering:
                if w.slot == slot:
                    return w, 0
        kv = self.settings.policy in ("kv", "kv-approx")
        mask = 0
        for w in answering:
            mask |= 1 << w.slot
        hashes: list[int] = []
        overlaps: dict[int, int] = {}
        if self.approx is not None:
            self.approx.expire(now)
            hashes = self._hashes(relay)  # all of them: the approximate index records them
            overlaps = self.approx.overlaps(hashes, mask)
        elif kv:
            # Hashed lazily: only as far as some worker holds the prefix (an unseen tail is never hashed).
            overlaps = self.index.overlaps(
                self._hasher_for().iter_hashes(req.prompt_token_ids, _salt(req)), mask
            )
        blocks = -(-len(req.prompt_token_ids) // max(self.block_size, 1))
        if kv:  # the cost from plain columns (this runs for every request)
            loads = [(overlaps.get(w.slot, 0), w.prefill_blocks, w.decode_blocks) for w in answering]
            costs = kv_costs(loads, blocks, self.settings.prefill_weight)
            if req.lora is not None:
                weight = self.settings.prefill_weight * blocks
                costs = [
                    c + weight * _lora_miss(w, req.lora.lora_name)
                    for c, w in zip(costs, answering, strict=True)
                ]
            slot = self.picker.pick_by_cost(
                [w.slot for w in answering], costs, [len(w.active) for w in answering]
            )
        else:
            cands = [
                Candidate(
                    slot=w.slot,
                    overlap_blocks=overlaps.get(w.slot, 0),
                    active_prefill_blocks=w.prefill_blocks,
                    active_decode_blocks=w.decode_blocks,
                    in_flight=len(w.active),
                    num_waiting=w.client.stats.num_waiting if w.client and w.client.stats else 0,
                )
                for w in answering
            ]
            slot = self.picker.pick(cands, blocks, req.routing_key).slot
        if role != "prefill" and parent != req.request_id:
            self._siblings[parent] = slot
            if len(self._siblings) > 4096:
                self._siblings.popitem(last=False)
        if self.approx is not None and hashes:
            self.approx.record(slot, hashes, time.monotonic())
        return self.workers[slot], overlaps.get(slot, 0)

    def add_request(self, req: EngineRequest, queue: asyncio.Queue | None = None) -> asyncio.Queue:
        q: asyncio.Queue = queue if queue is not None else asyncio.Queue()
        self.arrivals.append((time.monotonic(), len(req.prompt_token_ids)))
        relay = _Relay(self, req, q)
        if self.settings.disagg is not None and self._prefill_remotely(relay):
            self._pd_phase[req.request_id] = None
            asyncio.get_running_loop().create_task(self._disaggregated(relay))
        else:
            self._dispatch(relay, set())
        return q

    def _role(self) -> str | None:
        """Requests go to decode workers when the fleet is split into prefill and decode workers."""
        return "decode" if self.settings.disagg is not None else None

    def _prefill_remotely(self, relay: _Relay) -> bool:
        """Conditional disaggregation: the prompt's uncached part on the best decode worker is long,
        and some prefill worker has room."""
        d = self.settings.disagg
        assert d is not None
        params = relay.req.sampling_params
        if params.prompt_only or params.prompt_logprobs is not None:
            return False  # nothing to decode (embeddings, scoring), or rows a prefill worker keeps to itself
        now = time.monotonic()
        prefill = [w for w in self.workers if w.up and _fits(w, "prefill")]
        # An idle worker is heard from every half second: silence alone does not rule it out (as in _pick).
        prefill = [w for w in prefill if w.answering(now)] or prefill
        if not any(len(w.active) < d.max_prefill_inflight for w in prefill):
            return False
        try:
            _, overlap = self._pick(relay, set(), "decode")
        except EngineDeadError:
            return False
        uncached = len(relay.req.prompt_token_ids) - overlap * max(self.block_size, 1)
        return uncached >= d.min_prefill_tokens

    async def _disaggregated(self, relay: _Relay) -> None:
        """Prefill on a prefill worker (max_tokens 1, blocks kept), then decode on a decode worker that
        reads those blocks. Any failure on the way leaves the prompt to the decode worker."""
        d = self.settings.disagg
        assert d is not None
        req = relay.req
        rid = req.request_id
        if rid not in self._pd_phase:  # aborted before this task ran
            relay.queue.put_nowait(
                EngineCoreOutput(rid, [], finish_reason=FinishReason.ABORT, arrival_time=req.arrival_time)
            )
            return
        sp = dataclasses.replace(
            req.sampling_params, n=1, max_tokens=1, min_tokens=0, logprobs=None, structured=None,
            ignore_eos=True, speculative=False,
        )  # fmt: skip
        pre = dataclasses.replace(
            req, request_id=f"{rid}@prefill", sampling_params=sp, kv_transfer={"do_remote_decode": True}
        )
        pq: asyncio.Queue = asyncio.Queue()
        prelay = _Relay(self, pre, pq)
        self._pd_phase[rid] = prelay
        params = None
        try:
            self._dispatch(prelay, set(), "prefill")
            deadline = time.monotonic() + d.prefill_timeout_s
            while True:
                item = await asyncio.wait_for(pq.get(), max(deadline - time.monotonic(), 0.001))
                if isinstance(item, Exception):
                    raise item
                if item.finish_reason is not None:
                    params = item.kv_transfer
                    break
        except Exception as e:  # noqa: BLE001 - no prefill worker, it died, or it was too slow
            log.warning("remote prefill of %s failed (%s): the decode worker computes it", rid, e)
            self._forward([pre.request_id], finish=False)
        finally:
            aborted = rid not in self._pd_phase
            self._pd_phase.pop(rid, None)
        if aborted:
            relay.queue.put_nowait(
                EngineCoreOutput(
                    rid,
                    [],
                    finish_reason=FinishReason.ABORT,
                    num_prompt_tokens=len(req.prompt_token_ids),
                    arrival_time=req.arrival_time,
                )  # fmt: skip
            )
            return
        st = self.stats_router
        if params:
            st.disaggregated += 1
            relay.req = dataclasses.replace(req, kv_transfer={"remote": params})
        else:
            st.disagg_fallbacks += 1
        try:
            self._dispatch(relay, set())
        except Exception as e:  # noqa: BLE001 - no decode worker: the caller gets the error
            relay.queue.put_nowait(e if isinstance(e, EngineDeadError) else EngineDeadError(str(e)))

    def _dispatch(self, relay: _Relay, exclude: set[int], role: str | None = None) -> None:
        w, overlap = self._pick(relay, exclude, role or self._role())
        req = relay.req
        blocks = -(-len(req.prompt_token_ids) // max(self.block_size, 1))
        was = relay.slot
        relay.slot, relay.tries = w.slot, relay.tries + 1
        st = self.stats_router
        st.decisions[self.settings.policy] += 1
        st.overlap_blocks += overlap
        st.request_blocks += blocks
        w.add_active(req.request_id, _Active(max(blocks - overlap, 0), blocks))
        self.placements[req.request_id] = (w.slot, overlap)
        if len(self.placements) > 10_000:
            self.placements.popitem(last=False)
        self._where[req.request_id] = relay
        relay.sent_at = time.monotonic()
        assert w.client is not None
        if req.trace_context is not None and tracing.enabled():
            req = self._route_span(req, w, overlap, relay.tries)
        try:
            w.client.add_request(req, relay)  # type: ignore[arg-type]
        except Exception:  # not sent (its client has just failed): as if never picked
            w.drop_active(req.request_id)
            self._where.pop(req.request_id, None)
            relay.slot, relay.tries = was, relay.tries - 1
            raise

    def _route_span(self, req: EngineRequest, w: Worker, overlap: int, tries: int) -> EngineRequest:
        """The routing decision as a span (the worker's engine span hangs from it); a retry is another."""
        attributes = {
            "tokenmill.worker": w.url,
            "tokenmill.router.policy": self.settings.policy,
            "tokenmill.router.overlap_blocks": overlap,
            "tokenmill.router.try": tries,
        }
        if w.role:
            attributes["tokenmill.kv_role"] = w.role
        span = tracing.start_span("route", req.trace_context, "INTERNAL", attributes=attributes)
        span.end()
        return dataclasses.replace(req, trace_context=tracing.carrier_of(span))

    def _redispatch(self, relay: _Relay) -> None:
        """Send a request lost before its first token to a worker that answers now; with none, look
        again every RETRY_POLL_S (the loop goes on meanwhile) for settings.retry_wait_s, then end the
        request with EngineDeadError."""
        rid = relay.req.request_id
        if self._where.get(rid) is not relay:
            return  # aborted while the retry waited
        now = time.monotonic()
        if relay.wait_until is None:
            relay.wait_until = now + self.settings.retry_wait_s
        try:
            self._dispatch(relay, set())
        except EngineDeadError as e:
            if now < relay.wait_until:
                self._where[rid] = relay  # still findable for abort while it waits
                asyncio.get_running_loop().call_later(RETRY_POLL_S, self._redispatch, relay)
                return
            self._where.pop(rid, None)
            wait = self.settings.retry_wait_s
            relay.queue.put_nowait(EngineDeadError(f"{e} within {wait:g}s to take the request over"))
        except Exception as e:  # noqa: BLE001 - the caller gets the error
            self._where.pop(rid, None)
            relay.queue.put_nowait(EngineDeadError(str(e)))

    def _started(self, relay: _Relay) -> None:
        self.workers[relay.slot].start_active(relay.req.request_id)

    def _release(self, relay: _Relay) -> None:
        self.workers[relay.slot].drop_active(relay.req.request_id)
        if self._where.get(relay.req.request_id) is relay:
            del self._where[relay.req.request_id]

    def _forward(self, request_ids: list[str], finish: bool) -> None:
        by_worker: dict[int, list[str]] = {}
        for rid in request_ids:
            relay = self._where.pop(rid, None)
            if relay is None:
                continue
            self.workers[relay.slot].drop_active(rid)
            by_worker.setdefault(relay.slot, []).append(rid)
        for slot, ids in by_worker.items():
            c = self.workers[slot].client
            if c is not None and c.dead_reason is None:
                (c.finish if finish else c.abort)(ids)

    def abort(self, request_ids: list[str]) -> None:
        prefilling = [rid for rid in request_ids if rid in self._pd_phase]
        for rid in prefilling:  # its task sees it gone and ends the request
            prelay = self._pd_phase.pop(rid)
            if prelay is not None:
                self._forward([prelay.req.request_id], finish=False)
        self._forward(request_ids, finish=False)

    def finish(self, request_ids: list[str]) -> None:
        self._forward(request_ids, finish=True)

    def reset_prefix_cache(self) -> None:
        """Every live worker forgets its free cached blocks (their removals reach the KV index)."""
        for w in self.workers:
            if w.client is not None and w.client.dead_reason is None:
                w.client.reset_prefix_cache()

    @property
    def healthy(self) -> bool:
        return any(w.up for w in self.workers)

    @property
    def dead_reason(self) -> str | None:
        return None if self.healthy else "no worker is up"

    @property
    def engine_pid(self) -> int | None:
        return None

    @property
    def num_up(self) -> int:
        return sum(w.up for w in self.workers)

    @property
    def num_answering(self) -> int:
        """Workers that get new requests now (up, and heard from within SUSPECT_AFTER_S)."""
        now = time.monotonic()
        return sum(w.answering(now) for w in self.workers)

    async def shutdown(self) -> None:
        if self._task is not None:
            self._task.cancel()
        for w in self.workers:
            if w.subscriber is not None:
                await w.subscriber.stop()
            if w.client is not None:
                await w.client.shutdown()
        if self._ctx is not None:
            destroy_context(self._ctx)


def _fits(w: Worker, role: str | None) -> bool:
    """Whether a worker takes requests of a role: prefill ones need a worker that serves its blocks;
    decode ones (and all requests of an undivided fleet) go anywhere but to a prefill-only worker."""
    kv_role = w.info.get("kv_role")
    if role == "prefill":
        return kv_role in ("prefill", "both")
    if role == "decode":
        return kv_role != "prefill"
    return True


def startup_timeout_rejoin(startup_timeout: float) -> float:
    return min(startup_timeout, 5.0)


def _reachable(endpoint: str, worker_url: str) -> str:
    """A bound address (tcp://0.0.0.0:5557) as seen from here: the worker's host instead of a wildcard."""
    if not endpoint.startswith("tcp://"):
        return endpoint
    host, _, port = endpoint[len("tcp://") :].rpartition(":")
    if host in ("0.0.0.0", "*", "[::]", "::"):
        host = urlparse(worker_url.replace("tcp://", "http://", 1)).hostname or "127.0.0.1"
    return f"tcp://{host}:{port}"


def in_pool(w: Worker, pool: str | None) -> bool:
    """Whether a worker belongs to a pool of a disaggregated fleet (None: the whole fleet). A worker's
    launched role counts before it has joined and said its own."""
    if pool is None:
        return True
    role = w.role or w.info.get("kv_role")
    return (role == "prefill") == (pool == "prefill")


def _salt(req: EngineRequest) -> str | None:
    """What the workers salt the request's first block with: its cache salt and its LoRA adapter, so
    a prefix score counts only blocks cached under the same adapter."""
    return kv_salt(req.cache_salt, req.lora)


# LoRA affinity (llm-d's scorer in the KV cost's units): a worker whose slots hold the adapter costs
# nothing more; one with a free slot, a fifth of prefilling the prompt again (the adapter's read, and a
# slot taken from others); one with every slot busy, a whole prefill (the request would wait for a slot).
LORA_LOAD_COST, LORA_WAIT_COST = 0.2, 1.0


def _lora_miss(w: Worker, name: str) -> float:
    stats = w.client.stats if w.client is not None else None
    if stats is None or not stats.lora_slots:  # not heard from yet (or an older worker): assume room
        return LORA_LOAD_COST
    if name in stats.lora_resident:
        return 0.0
    return LORA_LOAD_COST if stats.lora_free_slots else LORA_WAIT_COST
