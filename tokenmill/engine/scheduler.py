"""The token-budget scheduler: no prefill or decode phases, only tokens computed and tokens wanted.

Each step hands out `max_num_batched_tokens`: first to running requests (in admission order), then to
waiting ones. A request whose prompt does not fit the remaining budget gets a chunk of it (chunked
prefill) and the rest in later steps. Requests join and leave between any two steps (in-flight
batching). When KV blocks run out, a running request is preempted: its blocks are freed and it will
recompute later (cheaply, from whatever of its prefix is still cached).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

from tokenmill.config import SchedulerConfig
from tokenmill.engine.fairness import TenantLedger, band_of, parse_tenant_names, parse_tenant_weights
from tokenmill.engine.kv_cache_manager import KVCacheManager
from tokenmill.engine.request import FinishReason, Request, RequestStatus
from tokenmill.engine.request_queue import make_waiting_queue
from tokenmill.lora.slots import LoRASlots
from tokenmill.worker.step import NewRequestData, RunningRequestData, SchedulerOutput


@dataclass
class _Scheduled:
    """The scheduler's own note of a request it scheduled this step (never leaves the scheduler)."""

    request: Request
    num_new_tokens: int
    start: int  # the request's num_computed_tokens when scheduled


class Scheduler:
    def __init__(
        self, config: SchedulerConfig, kv: KVCacheManager, max_model_len: int, max_loras: int = 0
    ) -> None:
        self.config = config
        # The workers' LoRA slots (None: LoRA off, and requests on an adapter are refused on arrival).
        self.loras = LoRASlots(max_loras) if max_loras else None
        self.kv = kv
        self.max_model_len = max_model_len
        self.waiting = make_waiting_queue(config)
        # Tenant names and tokens served per tenant (the fair queue's counters are charged alongside):
        # the configured names are kept for good, others while they have requests (fairness.py).
        known = [*parse_tenant_names(config.known_tenants), *parse_tenant_weights(config.tenant_weights)]
        self.tenants = TenantLedger(known=known)
        self.running: list[Request] = []
        self.requests: dict[str, Request] = {}
        # Requests waiting for a KV connector's background load, holding their blocks.
        self.loading: dict[str, Request] = {}
        # Finished requests whose blocks a KV connector keeps for another worker to read.
        self.held: dict[str, Request] = {}
        self.num_preemptions = 0
        # Requests ended since the last step: the workers forget them with the next step.
        self._finished_ids: list[str] = []
        # Called with each request as it ends, however it ends (the engine's trace spans).
        self.on_finished: Callable[[Request], None] | None = None

    # -- queue management -------------------------------------------------------------------
    def add_request(self, req: Request) -> None:
        if req.request_id in self.requests:
            raise ValueError(f"duplicate request id {req.request_id!r}")
        self.requests[req.request_id] = req
        req.tenant = self.tenants.enter(req.tenant)
        if self.config.policy == "fair":
            req.priority = band_of(req.priority)  # bands past the fair queue's range are its end bands
        self.waiting.push(req)

    def abort(self, request_ids: list[str]) -> list[Request]:
        return self.finish_requests(request_ids, FinishReason.ABORT)

    def has_unfinished(self) -> bool:
        return bool(self.requests or self.loading)

    def release_held(self, request_ids: list[str]) -> None:
        """Free the blocks of finished requests a KV connector had kept for a reader."""
        for rid in request_ids:
            req = self.held.pop(rid, None)
            if req is not None:
                self.kv.free(req)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    # -- one step -----------------------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        if self.held:
            self.release_held(self.kv.connector.expired(time.monotonic()))  # type: ignore[union-attr]
        budget = self.config.max_num_batched_tokens
        scheduled: dict[str, _Scheduled] = {}
        urgent_victims = self._make_room_for_urgent()
        preempted: list[Request] = []

        i = 0
        while i < len(self.running) and budget > 0:
            req = self.running[i]
            n = self._num_new_tokens(req, budget)
            if n <= 0:
                i += 1
                continue
            while not self.kv.allocate_slots(req, n):
                victim = self._pick_victim(self.running)
                pos = self.running.index(victim)
                budget += self._preempt(victim, scheduled)
                preempted.append(victim)
                if pos < i:
                    i -= 1
                if victim is req:
                    break
            if req.status == RequestStatus.RUNNING:
                # The budget may have cut into the drafts: verify only those that fit.
                del req.spec_token_ids[max(n - (req.num_tokens - req.num_computed_tokens), 0) :]
                scheduled[req.request_id] = _Scheduled(req, n, req.num_computed_tokens)
                self._prompt_served(req, req.num_computed_tokens, n)
                budget -= n
                i += 1

        # Admit waiting requests only when nobody had to be preempted for memory this step. (Requests
        # pushed out for a more urgent one leave room that the urgent one should take.)
        connector = self.kv.connector
        bs = self.kv.block_size
        no_slot: list[Request] = []  # requests whose adapter found no slot: back in the queue after
        while not preempted and len(self.waiting) and budget > 0:
            if len(self.running) >= self.config.max_num_seqs:
                break
            req = self.waiting.peek()
            if req.lora is not None and req.lora_slot < 0 and not self._take_lora_slot(req):
                no_slot.append(self.waiting.pop())  # every slot busy: the requests behind it go on
                continue
            computed, hit, ext, background = [], 0, 0, False
            # Mean and first-token pooling and prompt logprobs read a row of every prompt token (or the
            # first): cached blocks hold keys and values, not those, so such requests compute it whole.
            if req.num_computed_tokens == 0 and not req.params.reads_every_prompt_row:
                computed, hit = self.kv.get_computed_blocks(req)
                if connector is not None and self.kv.enable_prefix_caching and not req.kv_loaded:
                    ext, background = connector.num_external_blocks(req, len(computed))
            if background:
                # Blocks from the file tiers arrive in the background: the request waits aside, holding
                # its blocks, and the step goes on without it.
                fresh = self.kv.allocate_for_load(req, computed, ext)
                if fresh is None:
                    self._drop_lora_slot(req)
                    break
                self.waiting.pop()
                connector.after_alloc(req, fresh, len(computed), background=True)  # type: ignore[union-attr]
                req.status = RequestStatus.WAITING_FOR_KV
                req.kv_loaded = True
                req.kv_load_times = (time.monotonic(), None)
                self.loading[req.request_id] = req
                continue
            n = min(req.num_tokens - hit - ext * bs, budget)
            if self.config.long_prefill_token_threshold:
                n = min(n, self.config.long_prefill_token_threshold)
            # Blocks from host memory are copied in before this step's forward pass: they cost no budget.
            if not self.kv.allocate_slots(req, n + ext * bs, computed):
                self._drop_lora_slot(req)
                break
            if ext:
                req.kv_external_blocks += ext
                blocks = self.kv.req_blocks[req.request_id]
                connector.after_alloc(  # type: ignore[union-attr]
                    req, blocks[len(computed) : len(computed) + ext], len(computed), background=False
                )
                hit += ext * bs
            self.waiting.pop()
            self.kv.prefix_cache_queries += req.num_tokens
            self.kv.prefix_cache_hits += hit
            req.status = RequestStatus.RUNNING
            req.num_computed_tokens = hit
            if req.num_cached_tokens < 0:
                req.num_cached_tokens = hit
            if req.first_scheduled_time is None:
                req.first_scheduled_time = time.monotonic()
            self.running.append(req)
            scheduled[req.request_id] = _Scheduled(req, n, hit)
            self._prompt_served(req, hit, n)  # counted now: the next pick of this step sees it
            budget -= n
        for req in reversed(no_slot):
            self.waiting.push_front(req)

        return self._describe(scheduled, urgent_victims + preempted)

    def _take_lora_slot(self, req: Request) -> bool:
        """Give a waiting request on an adapter a slot holding it; False if every slot is busy."""
        assert self.loras is not None and req.lora is not None
        slot = self.loras.acquire(req.lora)
        if slot is None:
            return False
        req.lora_slot = slot
        return True

    def _drop_lora_slot(self, req: Request) -> None:
        if req.lora_slot >= 0:
            self.loras.release(req.lora_slot)  # type: ignore[union-attr]
            req.lora_slot = -1

    def finish_loads(self, done: dict[str, int]) -> None:
        """Background loads the workers finished (request id -> leading file blocks that arrived intact).
        The blocks that hold their content are named in the pool and the request goes back to the head
        of the queue holding none: its next admission finds them as ordinary prefix hits, and computes
        the rest (everything after a block that failed to load)."""
        connector = self.kv.connector
        assert connector is not None or not done
        for rid, num_ok in done.items():
            req = self.loading.pop(rid, None)
            if req is None:
                continue
            first, valid = connector.loaded(rid, num_ok)  # type: ignore[union-attr]
            if req.kv_load_times is not None:
                req.kv_load_times = (req.kv_load_times[0], time.monotonic())
            req.kv_external_blocks += valid
            if req.status == RequestStatus.FINISHED:  # aborted while loading: its blocks were kept
                req.num_computed_tokens = first * self.kv.block_size
                self.kv.free(req)
                continue
            self.kv.cache_loaded(req, first, valid)
            req.num_computed_tokens = (first + valid) * self.kv.block_size
            self.kv.free(req)
            req.num_computed_tokens = 0
            req.status = RequestStatus.WAITING
            self.waiting.push_front(req)

    def _describe(self, scheduled: dict[str, _Scheduled], preempted: list[Request]) -> SchedulerOutput:
        """The step as plain data: requests the workers do not hold in full, diffs for those they do."""
        out = SchedulerOutput(preempted_req_ids=[r.request_id for r in preempted])
        if self.loras is not None:
            out.lora_loads = self.loras.take_loads()
        if self.kv.connector is not None:
            out.kv_connector_metadata = self.kv.connector.build_meta()
        out.finished_req_ids, self._finished_ids = self._finished_ids, []
        for rid, s in scheduled.items():
            req = s.request
            blocks = self.kv.req_blocks[rid]
            if req.num_sent_tokens == 0:
                out.new_requests.append(
                    NewRequestData(
                        rid,
                        req.prompt_token_ids,
                        list(req.output_token_ids),
                        req.params,
                        sorted(req.eos_token_ids),
                        [b.block_id for b in blocks],
                        s.start,
                        req.lora_slot,
                    )
                )
            else:
                out.running_requests.append(
                    RunningRequestData(
                        rid,
                        req.all_token_ids[req.num_sent_tokens :],
                        # Only the tail the workers lack: a long request's table is not rebuilt each step.
                        [b.block_id for b in blocks[req.num_sent_blocks :]],
                        s.start,
                    )
                )
            req.num_sent_tokens, req.num_sent_blocks = req.num_tokens, len(blocks)
            out.num_scheduled_tokens[rid] = s.num_new_tokens
            if req.spec_token_ids:
                out.spec_token_ids[rid] = list(req.spec_token_ids)
        return out

    def _make_room_for_urgent(self) -> list[Request]:
        """Priority and fair policies: preempt running requests of strictly lower priority (larger value:
        a higher band) while the most urgent waiting request lacks a slot or blocks. Done before anything
        is allocated this step, so no block named in this step is ever given up."""
        victims: list[Request] = []
        if not self.waiting.by_priority:
            return victims
        while len(self.waiting) and self.running:
            head = self.waiting.peek()
            victim = self._pick_victim(self.running)
            if victim.priority <= head.priority:
                break
            first_chunk = min(head.num_tokens, self.config.max_num_batched_tokens)
            short_of_seqs = len(self.running) >= self.config.max_num_seqs
            if not short_of_seqs and self.kv.can_allocate(head, first_chunk):
                break
            self._preempt(victim, {})
            victims.append(victim)
        return victims

    def _num_new_tokens(self, req: Request, budget: int) -> int:
        n = min(req.num_tokens + len(req.spec_token_ids) - req.num_computed_tokens, budget)
        if self.config.long_prefill_token_threshold:
            n = min(n, self.config.long_prefill_token_threshold)
        return n

    def _pick_victim(self, running: list[Request]) -> Request:
        if self.waiting.by_priority:
            return max(running, key=self.waiting.victim_key)  # least urgent (fair: served most), latest
        return running[-1]  # last admitted

    def _prompt_served(self, req: Request, start: int, n: int) -> None:
        """Count the prompt tokens of a scheduled chunk to its tenant, each once (prefix-cache hits and
        recomputation after a preemption count nothing)."""
        end = min(start + n, req.num_prompt_tokens)
        fresh = end - max(start, req.num_prompt_charged)
        if fresh > 0:
            req.num_prompt_charged = end
            self._served(req, fresh, 0)

    def _served(self, req: Request, n_in: int, n_out: int) -> None:
        self.tenants.add(req.tenant, n_in, n_out)
        self.waiting.charge(req, n_in, n_out)

    def _preempt(self, victim: Request, scheduled: dict[str, _Scheduled]) -> int:
        """Free the victim's blocks and requeue it; return the token budget it had been given this step."""
        returned = 0
        if victim.request_id in scheduled:
            returned = scheduled.pop(victim.request_id).num_new_tokens
        self.running.remove(victim)
        self.kv.free(victim)
        self._drop_lora_slot(victim)
        victim.num_computed_tokens = 0
        victim.num_sent_tokens = victim.num_sent_blocks = 0  # the workers drop it: it comes back whole
        victim.spec_token_ids = []
        if not victim.prompt_logprobs_sent:
            victim.prompt_logprobs = []  # its prompt is read again, and its logprobs with it
        victim.status = RequestStatus.PREEMPTED
        victim.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.push_front(victim)
        return returned

    # -- after the forward pass -------------------------------------------------------------
    def update(
        self,
        out: SchedulerOutput,
        sampled: dict[str, list[int]],
        drafts: dict[str, list[int]] | None = None,
    ) -> list[tuple[Request, int]]:
        """Advance computed tokens, append sampled ones (a step may bring several per request: accepted
        drafts and one more), finish what must stop, and keep the proposer's new drafts. Returns each
        request that got tokens, with how many it kept."""
        now = time.monotonic()
        touched = []
        starts = out.num_computed_before()
        drafts = drafts or {}
        for rid, n in out.num_scheduled_tokens.items():
            req = self.requests.get(rid)
            if req is None:
                continue
            new = sampled.get(rid, ())
            # Drafts past the first rejection were computed for nothing: their KV slots are rewritten
            # by the next step. (k drafts verified, len(new) - 1 of them accepted.)
            rejected = len(out.spec_token_ids.get(rid, ())) - max(len(new) - 1, 0)
            req.num_computed_tokens = starts[rid] + n - rejected
            kept = 0
            for token in new:
                req.append_token(token, now)
                kept += 1
                reason = req.check_stop()
                if reason is not None:
                    self.running.remove(req)
                    self._finish(req, reason, now)
                    break
            if kept:
                touched.append((req, kept))
                self._served(req, 0, kept)
            if not req.is_finished:
                req.spec_token_ids = self._usable_drafts(req, drafts.get(rid, []))
        return touched

    def _usable_drafts(self, req: Request, draft: list[int]) -> list[int]:
        """Drafts that can still matter: none past max_tokens (the step after the last draft samples one
        more token of its own) or past the context length."""
        room = min(req.max_tokens - len(req.output_token_ids) - 1, self.max_model_len - req.num_tokens)
        return draft[: max(room, 0)]

    def finish_requests(self, request_ids: list[str], reason: FinishReason) -> list[Request]:
        """End requests for a reason found outside the engine loop (an abort, a stop string); unknown
        or already finished ids are ignored. Returns the requests ended."""
        ended = []
        for rid in request_ids:
            req = self.requests.get(rid)
            if req is None:
                continue
            if req.status == RequestStatus.RUNNING:
                self.running.remove(req)
            elif req.status == RequestStatus.WAITING_FOR_KV:
                # The worker may still be writing into its blocks: they are freed when the load ends.
                self._finish(req, reason, free=False)
                ended.append(req)
                continue
            else:
                self.waiting.remove(req)
            self._finish(req, reason)
            ended.append(req)
        return ended

    def _finish(
        self, req: Request, reason: FinishReason, now: float | None = None, free: bool = True
    ) -> None:
        req.status = RequestStatus.FINISHED
        req.finish_reason = reason
        req.finished_time = now or time.monotonic()
        conn = self.kv.connector
        if free and conn is not None and reason in (FinishReason.STOP, FinishReason.LENGTH):
            keep, req.kv_transfer_out = conn.request_finished(req, self.kv.block_ids(req.request_id))
            if keep:
                self.held[req.request_id] = req
                free = False
        if free:
            self.kv.free(req)
        self._drop_lora_slot(req)
        self.requests.pop(req.request_id, None)
        self.tenants.leave(req.tenant)
        self.waiting.done(req)  # its tenant's last request in its band: the tenant may be lifted again
        self._finished_ids.append(req.request_id)
        if self.on_finished is not None:  # last: the request is done with whatever the hook does
            self.on_finished(req)
