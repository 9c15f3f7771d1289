"""Workers as actors of a real local Ray instance: placed by Ray, found through Ray, routed by prefix,
and brought back by Ray after one is killed (the router finds its new address and rejoins it)."""

from __future__ import annotations

import asyncio
import os
import signal
import time

import pytest

ray = pytest.importorskip("ray", reason="the Ray launcher needs the optional extra tokenmill[ray]")

from tokenmill.cluster.ray_launcher import RayRouter  # noqa: E402
from tokenmill.cluster.router import RouterSettings  # noqa: E402
from tokenmill.config import CacheConfig, EngineConfig  # noqa: E402
from tokenmill.frontend.async_llm import AsyncLLM  # noqa: E402
from tokenmill.sampling_params import SamplingParams  # noqa: E402

pytestmark = pytest.mark.slow

CONFIG = EngineConfig(max_model_len=512, cache=CacheConfig(kv_cache_memory_gb=0.05))
GREEDY = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)


@pytest.fixture(scope="module")
def local_ray():
    os.environ["RAY_USAGE_STATS_ENABLED"] = "0"
    ray.init(
        address="local",
        num_cpus=2,
        include_dashboard=False,
        log_to_driver=False,
        object_store_memory=100 * 2**20,
        namespace="tokenmill-tests",
    )
    yield
    ray.shutdown()


async def run(llm: AsyncLLM, rid: str, ids: list[int]) -> None:
    async for ro in llm.generate(rid, ids, GREEDY):
        last = ro
    assert last.finished


async def until(cond, timeout: float) -> None:  # noqa: ANN001
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, "timed out"
        await asyncio.sleep(0.1)


def test_ray_actors_serve_route_and_come_back(local_ray) -> None:
    async def main() -> None:
        router = RayRouter(CONFIG, 2, RouterSettings("kv"), cpus_per_worker=1.0, host="127.0.0.1")
        llm = await AsyncLLM.start(CONFIG, client=router)
        try:
            assert router.num_up == 2
            assert all(w.url.startswith("tcp://127.0.0.1:") for w in router.workers)
            text = "A system prompt shared by a whole team of analysts, about ports and shipping. " * 4
            base = llm.tokenizer.encode(text)
            await run(llm, "first", base + llm.tokenizer.encode(" One?"))
            home = router.placements["first"][0]
            await until(lambda: router.indexed_blocks >= len(base) // 16, 30)
            await run(llm, "second", base + llm.tokenizer.encode(" Two?"))
            assert router.placements["second"] == (home, len(base) // 16)

            # Kill the actor's process: Ray restarts it (max_restarts=-1) at a new address, and the
            # router rejoins it there.
            old_url = router.workers[home].url
            os.kill(router.actor_pid(home), signal.SIGKILL)
            await until(lambda: router.num_up == 1, 10)
            await run(llm, "meanwhile", base + llm.tokenizer.encode(" Three?"))
            await until(lambda: router.num_up == 2, 180)
            assert router.workers[home].url != old_url and router.workers[home].joins == 2
        finally:
            await llm.shutdown()

    asyncio.run(main())


def test_ray_actors_as_a_prefill_and_a_decode_worker(local_ray) -> None:
    from tokenmill.cluster.disagg import DisaggSettings

    disagg = DisaggSettings(1, 1, min_prefill_tokens=64)
    settings = RouterSettings("kv", disagg=disagg)

    async def main() -> None:
        router = RayRouter(CONFIG, 2, settings, cpus_per_worker=1.0, host="127.0.0.1", roles=disagg.roles())
        llm = await AsyncLLM.start(CONFIG, client=router)
        try:
            assert sorted(w.info.get("kv_role") for w in router.workers) == ["decode", "prefill"]
            ids = llm.tokenizer.encode(
                "Ray places a prefill worker and a decode worker; the blocks move. " * 5
            )
            await run(llm, "long", ids)
            assert router.stats_router.disaggregated == 1 and router.stats_router.disagg_fallbacks == 0
            decode = next(w for w in router.workers if w.info.get("kv_role") == "decode")
            assert router.placements["long"][0] == decode.slot
            assert router.worker_stats()[decode.name].kv_connector["remote_loaded_blocks"] > 0
        finally:
            await llm.shutdown()

    asyncio.run(main())


def test_the_planners_connector_adds_and_drains_ray_actors(local_ray) -> None:
    from tokenmill.cluster.planner.connectors import FleetConnector

    async def main() -> None:
        router = RayRouter(CONFIG, 1, RouterSettings("kv"), cpus_per_worker=1.0, host="127.0.0.1")
        llm = await AsyncLLM.start(CONFIG, client=router)
        connector = FleetConnector(router, drain_timeout_s=30)
        try:
            assert connector.counts() == (1, 0, 0)
            await connector.scale_to(2)
            assert connector.counts()[0] + connector.counts()[1] == 2
            await until(lambda: connector.counts() == (2, 0, 0), 180)
            ids = llm.tokenizer.encode("Scaled out on Ray. " * 4)
            await run(llm, "after-up", ids)
            await connector.scale_to(1)
            await until(lambda: connector.counts() == (1, 0, 0), 60)
            await run(llm, "after-down", ids)
        finally:
            await llm.shutdown()

    asyncio.run(main())
