"""Prefill/decode orchestration: when a request's prompt is worth a prefill worker (conditional
disaggregation), and the two legs: prefill there (max_tokens 1, blocks kept), then decode on a decode
worker that reads those blocks. Any failure on the way leaves the prompt to the decode worker."""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from typing import TYPE_CHECKING

from tokenmill.cluster.disagg import DisaggSettings
from tokenmill.cluster.router.relay import Relay
from tokenmill.cluster.router.worker import fits
from tokenmill.engine.client import EngineDeadError
from tokenmill.engine.protocol import EngineCoreOutput, FinishReason

if TYPE_CHECKING:
    from tokenmill.cluster.router.client import RouterEngineClient

log = logging.getLogger(__name__)


class PDOrchestrator:
    def __init__(self, router: RouterEngineClient, settings: DisaggSettings) -> None:
        self.router, self.settings = router, settings
        # Requests whose prompt a prefill worker is computing -> that prefill's relay (None: not sent yet).
        self.phase: dict[str, Relay | None] = {}

    def start(self, relay: Relay) -> bool:
        """Send the request through a prefill worker if that is worth it (True), else leave it (False)."""
        if not self._prefill_remotely(relay):
            return False
        self.phase[relay.req.request_id] = None
        asyncio.get_running_loop().create_task(self._disaggregated(relay))
        return True

    def abort(self, request_ids: list[str]) -> None:
        """Requests aborted while prefilling: their task sees them gone and ends them."""
        for rid in request_ids:
            if rid in self.phase:
                prelay = self.phase.pop(rid)
                if prelay is not None:
                    self.router.forward([prelay.req.request_id], finish=False)

    def _prefill_remotely(self, relay: Relay) -> bool:
        """Conditional disaggregation: the prompt's uncached part on the best decode worker is long,
        and some prefill worker has room."""
        d, r = self.settings, self.router
        params = relay.req.sampling_params
        if params.prompt_only or params.prompt_logprobs is not None:
            return False  # nothing to decode (embeddings, scoring), or rows a prefill worker keeps to itself
        now = time.monotonic()
        prefill = [w for w in r.workers if w.usable() and fits(w, "prefill")]
        # An idle worker is heard from every half second: silence alone does not rule it out (as in pick).
        prefill = [w for w in prefill if w.answering(now)] or prefill
        if not any(len(w.active) < d.max_prefill_inflight for w in prefill):
            return False
        try:
            _, overlap = r.pick(relay, set(), "decode")
        except EngineDeadError:
            return False
        uncached = len(relay.req.prompt_token_ids) - overlap * max(r.block_size, 1)
        return uncached >= d.min_prefill_tokens

    async def _disaggregated(self, relay: Relay) -> None:
        d, r = self.settings, self.router
        req = relay.req
        rid = req.request_id
        if rid not in self.phase:  # aborted before this task ran
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
        prelay = Relay(r, pre, pq)
        self.phase[rid] = prelay
        params = None
        try:
            r.dispatch(prelay, set(), "prefill")
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
            r.forward([pre.request_id], finish=False)
        finally:
            aborted = rid not in self.phase
            self.phase.pop(rid, None)
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
        st = r.stats_router
        if params:
            st.disaggregated += 1
            relay.req = dataclasses.replace(req, kv_transfer={"remote": params})
        else:
            st.disagg_fallbacks += 1
        try:
            r.dispatch(relay, set())
        except Exception as e:  # noqa: BLE001 - no decode worker: the caller gets the error
            r._end(relay, e if isinstance(e, EngineDeadError) else EngineDeadError(str(e)))
