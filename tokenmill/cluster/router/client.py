"""The router as an EngineClient: each request to the worker its policy picks, sent on when that worker
is lost before the first token, and its load kept for the next decision.

The jobs live beside it: who is in the fleet and whether they answer (membership.py), the candidates kept
ready for new requests (board.py), how much of a prompt each worker holds (prefix_index.py), the policies
(cluster/policies/), prefill/decode orchestration (pd.py), the queue for a full fleet (fleet_queue.py),
requests waiting for a cold start (cold_start.py), and the router's own metrics (metrics.py).
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import itertools
import time
from collections import OrderedDict
from collections.abc import Iterator

import zmq.asyncio
from prometheus_client.core import Metric

from tokenmill import tracing
from tokenmill.cluster.discovery import Discovery
from tokenmill.cluster.policies import Candidates, make_policy
from tokenmill.cluster.router.board import Board
from tokenmill.cluster.router.cold_start import ColdStartQueue
from tokenmill.cluster.router.fleet_queue import FleetQueue
from tokenmill.cluster.router.membership import Membership
from tokenmill.cluster.router.metrics import RouterStats, router_metrics
from tokenmill.cluster.router.pd import PDOrchestrator
from tokenmill.cluster.router.prefix_index import PrefixIndex
from tokenmill.cluster.router.relay import Relay
from tokenmill.cluster.router.settings import RETRY_POLL_S, RouterSettings
from tokenmill.cluster.router.worker import Active, Worker, fits
from tokenmill.engine.client import EngineClient, EngineDeadError, destroy_context
from tokenmill.engine.fairness import band_of
from tokenmill.engine.protocol import EngineRequest, EngineStats


class RouterEngineClient(Membership, EngineClient):
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
        self.policy = make_policy(s.policy, s.temperature, s.prefill_weight, s.seed)
        self.workers = [Worker(i, u, names[i] if names else u) for i, u in enumerate(urls)]
        self.prefix = PrefixIndex(s.approx_ttl_s if s.policy == "kv-approx" else None)
        self.board = Board()
        self.pd = PDOrchestrator(self, s.disagg) if s.disagg is not None else None
        self.stats_router = RouterStats()
        self.startup_timeout, self.heartbeat_timeout = startup_timeout, heartbeat_timeout
        self.info = {}
        self.block_size = 0
        self._where: dict[str, Relay] = {}
        self._joins: set[asyncio.Task] = set()
        # (time, prompt tokens) of recent requests: the arrival rate the planner forecasts from.
        self.arrivals: collections.deque[tuple[float, int]] = collections.deque(maxlen=200_000)
        self._siblings: OrderedDict[str, int] = OrderedDict()  # parent request id -> slot (n > 1)
        # Where recent requests went, and the blocks credited there (for logs, tests and debugging).
        self.placements: OrderedDict[str, tuple[int, int]] = OrderedDict()
        self._ctx: zmq.asyncio.Context | None = None
        self._task: asyncio.Task | None = None
        # A fleet that may scale to zero keeps new requests waiting while no worker is in rotation.
        self.cold_start = (
            ColdStartQueue(s.cold_start_timeout_s, s.cold_start_max_waiting) if s.scale_to_zero else None
        )
        # A fleet whose workers are all full keeps new requests here, in band and tenant order.
        self.fleet_queue = (
            FleetQueue(
                s.queue_max_in_flight,
                s.queue_fair,
                s.tenant_weights,
                s.fair_input_weight,
                s.fair_output_weight,
            )
            if s.queue
            else None
        )
        self._release_pending = False

    @property
    def stats(self) -> EngineStats | None:  # type: ignore[override]
        """The fleet's stats: counts summed, KV usage averaged over the workers that are up."""
        got = list(self.worker_stats().values())
        if not got:
            return None
        return EngineStats(
            num_running=sum(s.num_running for s in got),
            # the requests waiting at the router (its queue) wait as surely as those in an engine's
            num_waiting=sum(s.num_waiting for s in got) + (len(self.fleet_queue) if self.fleet_queue else 0),
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

    def worker_stats(self) -> dict[str, EngineStats]:
        return {w.name: w.client.stats for w in self.workers if w.up and w.client and w.client.stats}

    def router_metrics(self, model: str) -> Iterator[Metric]:
        """Prometheus families of the router's own (decisions, overlap credited, retries, workers)."""
        return router_metrics(self, model)

    @property
    def indexed_blocks(self) -> int:
        return len(self.prefix)

    def set_policy(self, policy: str) -> None:
        """Route by another policy from now on (kv-approx's own index only exists if started with it)."""
        if policy == "kv-approx" and self.prefix.approx is None:
            raise ValueError("kv-approx must be chosen when the router starts")
        s = self.settings
        self.policy = make_policy(policy, s.temperature, s.prefill_weight, s.seed)
        s.policy = policy

    # -- choosing a worker ------------------------------------------------------------------------
    def pick(self, relay: Relay, exclude: set[int], role: str | None = None) -> tuple[Worker, int]:
        """The worker for a request (and the prompt blocks it holds). A retry goes only to a worker that
        answers now, and not again to one it was lost on (unless that worker has rejoined since)."""
        now = time.monotonic()
        req = relay.req
        if relay.tries == 0 and not exclude and not relay.failed:
            cands = self.board.candidates(self.workers, role, now)
        else:
            cands = self._retry_candidates(relay, exclude, role, now)
        if cands is None:
            raise EngineDeadError("no worker is up")
        fq = self.fleet_queue
        if fq is not None and len(cands.workers) > 1:  # a worker with room before one without
            roomy = [w for w in cands.workers if not fq.full(w)]
            if roomy and len(roomy) < len(cands.workers):
                cands = Candidates(roomy)
        parent = req.request_id.split("#", 1)[0]
        if role != "prefill" and parent != req.request_id and parent in self._siblings:
            w = cands.by_slot.get(self._siblings[parent])
            if w is not None and w.usable():  # the siblings of an n > 1 request share their prompt's blocks
                return w, 0
        overlaps = self.prefix.overlaps(relay, cands.mask, now) if self.policy.uses_prefix else {}
        blocks = -(-len(req.prompt_token_ids) // max(self.block_size, 1))
        w = self.policy.choose(cands, overlaps, blocks, req)
        if not w.usable():  # died (or began to drain) since the candidates were kept
            self.board.invalidate()
            return self.pick(relay, exclude | {w.slot}, role)
        if role != "prefill" and parent != req.request_id:
            self._siblings[parent] = w.slot
            if len(self._siblings) > 4096:
                self._siblings.popitem(last=False)
        self.prefix.placed(w.slot, relay, now)
        return w, overlaps.get(w.slot, 0)

    def _retry_candidates(
        self, relay: Relay, exclude: set[int], role: str | None, now: float
    ) -> Candidates | None:
        ups = [
            w
            for w in self.workers
            if w.usable()
            and w.slot not in exclude
            and fits(w, role)
            and (w.slot, w.joins) not in relay.failed
        ]
        # A worker silent for a while gets no new requests; all of them silent: a long step, not death
        # (settings.lost_after_s bounds the wait). A retry never waits on one that has not proven it answers.
        answering = [w for w in ups if w.answering(now)]
        if not answering and relay.tries == 0:
            answering = ups
        if not answering:
            if ups:
                raise EngineDeadError("no worker answers")
            return None
        return Candidates(answering)

    # -- requests -----------------------------------------------------------------------------
    def add_request(self, req: EngineRequest, queue: asyncio.Queue | None = None) -> asyncio.Queue:
        q: asyncio.Queue = queue if queue is not None else asyncio.Queue()
        if not req.request_id.startswith("health-"):  # a probe's token is not traffic (server/probes.py)
            self.arrivals.append((time.monotonic(), len(req.prompt_token_ids)))
        relay = Relay(self, req, q)
        fq = self.fleet_queue
        if fq is None or req.request_id.startswith("health-"):  # a probe does not wait behind traffic
            self._send(relay)
            return q
        exclude = self._must_wait(relay)
        if exclude is None:
            fq.hold(relay)
            self._where[req.request_id] = relay  # findable for abort while it waits
            return q
        fq.arrive(relay)
        try:
            if exclude:  # an urgent request, to a worker whose engine can preempt for it
                self.dispatch(relay, exclude)
            else:
                self._send(relay)
        except Exception:
            fq.ended(req.request_id)
            raise
        return q

    def _send(self, relay: Relay) -> None:
        if self.pd is None or not self.pd.start(relay):
            self.dispatch(relay, set())

    # -- the router's queue, while every worker is full ---------------------------------------------
    def _must_wait(self, relay: Relay) -> set[int] | None:
        """Whether a new request waits at the router (None), and if not, the workers it must not go to
        (empty: any). It waits when others already wait (it does not pass them) or every worker in
        rotation is full, unless some worker runs a less urgent band: it goes there, where the engine
        preempts for it. With no worker in rotation it does not wait here: it fails, or waits for a
        cold start, as it would without the queue."""
        fq = self.fleet_queue
        assert fq is not None
        cands = self.board.candidates(self.workers, self._role(), time.monotonic())
        if cands is None or (not fq.held and fq.has_room(cands.workers, self._promised())):
            return set()
        targets = fq.preemptible(cands.workers, relay.priority)
        if targets:
            return {w.slot for w in self.workers} - {w.slot for w in targets}
        return None

    def _role(self) -> str | None:
        return "decode" if self.pd is not None else None

    def _promised(self) -> int:
        """Requests prefilling on a prefill worker: each takes a decode worker's place when it is done."""
        return len(self.pd.phase) if self.pd is not None else 0

    def _release_soon(self) -> None:
        """A place may have freed: hand it out once the current outputs are handled."""
        fq = self.fleet_queue
        if fq is None or not fq.held or self._release_pending:
            return
        self._release_pending = True
        try:
            asyncio.get_running_loop().call_soon(self._release_held)
        except RuntimeError:  # no loop (a test calling in directly)
            self._release_held()

    def _release_held(self) -> None:
        """Send waiting requests, next first, while some worker has room; with no worker in rotation,
        every one of them, so each fails or waits for a cold start rather than here."""
        self._release_pending = False
        fq = self.fleet_queue
        if fq is None:
            return
        while fq.held:
            cands = self.board.candidates(self.workers, self._role(), time.monotonic())
            if cands is not None and not fq.has_room(cands.workers, self._promised()):
                return
            relay = fq.next()
            try:
                self._send(relay)
            except Exception as e:  # noqa: BLE001 - the caller gets the error
                self._end(relay, e if isinstance(e, EngineDeadError) else EngineDeadError(str(e)))

    def _end(self, relay: Relay, error: Exception) -> None:
        """End a request the router holds with an error (no worker has it)."""
        rid = relay.req.request_id
        if self._where.get(rid) is relay:
            del self._where[rid]
        if self.fleet_queue is not None:
            self.fleet_queue.ended(rid)
        relay.queue.put_nowait(error)

    def dispatch(self, relay: Relay, exclude: set[int], role: str | None = None) -> None:
        if role is None:
            # a fleet split into prefill and decode workers decodes on decode workers; a retry keeps the
            # role of its first try (a prefill leg goes to another prefill worker)
            role = relay.role or ("decode" if self.pd is not None else None)
        relay.role = role
        try:
            w, overlap = self.pick(relay, exclude, role)
        except EngineDeadError:
            if self.cold_start is None or any(w.usable() for w in self.workers):
                raise
            # No worker in rotation in a fleet that scales to zero: wait for one to start (findable for
            # abort meanwhile); over the bound, ColdStartFullError.
            self.cold_start.park(relay)
            self._where[relay.req.request_id] = relay
            self.cold_start.wake()
            return
        req = relay.req
        blocks = -(-len(req.prompt_token_ids) // max(self.block_size, 1))
        was = relay.slot
        relay.slot, relay.tries = w.slot, relay.tries + 1
        st = self.stats_router
        st.decisions[self.settings.policy] += 1
        st.overlap_blocks += overlap
        st.request_blocks += blocks
        w.add_active(req.request_id, Active(max(blocks - overlap, 0), blocks, band=band_of(req.priority)))
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

    def redispatch(self, relay: Relay) -> None:
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
            self.dispatch(relay, set())
        except EngineDeadError as e:
            if now < relay.wait_until:
                self._where[rid] = relay  # still findable for abort while it waits
                asyncio.get_running_loop().call_later(RETRY_POLL_S, self.redispatch, relay)
                return
            self._end(
                relay, EngineDeadError(f"{e} within {self.settings.retry_wait_s:g}s to take the request over")
            )
        except Exception as e:  # noqa: BLE001 - the caller gets the error
            self._end(relay, EngineDeadError(str(e)))

    def _joined(self) -> None:
        """A worker joined: the requests waiting for a cold start go to the fleet now."""
        if self.cold_start is None or not self.cold_start.waiting:
            return
        now = time.monotonic()
        fq = self.fleet_queue
        if fq is not None:  # they wait for places in the router's queue, in its order, not all at once
            for since, relay in self.cold_start.take_all():
                if self._where.get(relay.req.request_id) is relay:
                    relay.cold_served = True
                    self.cold_start.stats.observe(now - since)
                    fq.hold(relay)
            self._release_held()
            return
        # Oldest first; one put back is appended, still in order: nothing new parks during this loop.
        for since, relay in self.cold_start.take_all():
            rid = relay.req.request_id
            if self._where.get(rid) is not relay:
                continue  # aborted meanwhile
            try:
                self.dispatch(relay, set())
            except EngineDeadError as e:
                if any(w.usable() for w in self.workers):
                    self._end(relay, e)
                else:  # its worker failed as it was sent and none is left: it waits on, from its arrival
                    self._where[rid] = relay  # (dispatch forgot it when the send failed)
                    self.cold_start.put_back(since, relay)
                continue
            except Exception as e:  # noqa: BLE001 - the caller gets the error
                self._end(relay, EngineDeadError(str(e)))
                continue
            # (dispatch parked it again if the worker left at once: it waits on from its first park)
            if rid not in self.cold_start.waiting and not relay.cold_served:
                relay.cold_served = True
                self.cold_start.stats.observe(now - since)

    def _expire_cold_waits(self, now: float) -> None:
        """End the requests that waited for a cold start longer than the timeout."""
        if self.cold_start is None or not self.cold_start.waiting:
            return
        wait = self.cold_start.timeout_s
        for relay in self.cold_start.expired(now):
            if self._where.get(relay.req.request_id) is relay:
                self._end(relay, EngineDeadError(f"no worker started within {wait:g}s (cold start)"))

    def started(self, relay: Relay) -> None:
        self.workers[relay.slot].start_active(relay.req.request_id)

    def release(self, relay: Relay) -> None:
        rid = relay.req.request_id
        self.workers[relay.slot].drop_active(rid)
        if self._where.get(rid) is relay:
            del self._where[rid]
        if self.fleet_queue is not None:
            self.fleet_queue.ended(rid)
            self._release_soon()

    def forward(self, request_ids: list[str], finish: bool) -> None:
        """Abort (or finish) requests on the workers that have them."""
        by_worker: dict[int, list[str]] = {}
        fq = self.fleet_queue
        for rid in request_ids:
            if fq is not None:  # wherever it is (one prefilling on a prefill worker is not in _where)
                fq.ended(rid)
            relay = self._where.pop(rid, None)
            if relay is None:
                continue
            if fq is not None and fq.drop(rid):
                continue  # waiting in the router's queue: on no worker yet
            if self.cold_start is not None and self.cold_start.drop(rid):
                continue  # waiting for a cold start: on no worker yet
            if relay.slot < 0:
                continue  # prefilling on a prefill worker since it left the router's queue (pd.abort)
            self.workers[relay.slot].drop_active(rid)
            by_worker.setdefault(relay.slot, []).append(rid)
        for slot, ids in by_worker.items():
            c = self.workers[slot].client
            if c is not None and c.dead_reason is None:
                (c.finish if finish else c.abort)(ids)
        if by_worker:
            self._release_soon()  # their places are free

    def abort(self, request_ids: list[str]) -> None:
        if self.pd is not None:
            self.pd.abort(request_ids)
        self.forward(request_ids, finish=False)

    def finish(self, request_ids: list[str]) -> None:
        self.forward(request_ids, finish=True)

    def reset_prefix_cache(self) -> None:
        """Every live worker forgets its free cached blocks (their removals reach the KV index)."""
        for w in self.workers:
            if w.client is not None and w.client.dead_reason is None:
                w.client.reset_prefix_cache()

    @property
    def engine_pid(self) -> int | None:
        return None

    async def shutdown(self) -> None:
        if self._task is not None:
            self._task.cancel()
        if self.cold_start is not None:
            for _, relay in self.cold_start.take_all():
                relay.queue.put_nowait(EngineDeadError("the router is shutting down"))
        if self.fleet_queue is not None:
            while self.fleet_queue.held:
                self.fleet_queue.next().queue.put_nowait(EngineDeadError("the router is shutting down"))
        for w in self.workers:
            if w.subscriber is not None:
                await w.subscriber.stop()
            if w.client is not None:
                await w.client.shutdown()
        if self._ctx is not None:
            destroy_context(self._ctx)
