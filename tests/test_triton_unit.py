"""Model repository pieces on their own: config.pbtxt, tensors, the dynamic and sequence batchers."""

from __future__ import annotations

import asyncio
import threading
import time
from pathlib import Path

import numpy as np
import pytest

from tokenmill.triton import dtypes
from tokenmill.triton.backends import InferRequest, Instance
from tokenmill.triton.config import load_config
from tokenmill.triton.pbtxt import ConfigError, parse
from tokenmill.triton.scheduling import DefaultScheduler, DynamicBatcher, InferError
from tokenmill.triton.sequence import SequenceBatcher
from tokenmill.triton.stats import ModelStats

EXAMPLES = Path(__file__).resolve().parent.parent / "examples" / "model_repository"


def write(tmp_path: Path, text: str, name: str = "m") -> Path:
    d = tmp_path / name
    (d / "1").mkdir(parents=True, exist_ok=True)
    (d / "config.pbtxt").write_text(text)
    return d


def test_every_example_config_parses() -> None:
    names = sorted(p.name for p in EXAMPLES.iterdir() if (p / "config.pbtxt").exists())
    assert names == ["accumulator", "batch_probe", "linear_onnx", "pipeline", "preprocess", "sleeper"]
    cfgs = {n: load_config(EXAMPLES / n) for n in names}
    assert cfgs["linear_onnx"].backend == "onnxruntime" and cfgs["linear_onnx"].dynamic_batching == {
        "preferred_batch_size": [4, 8],
        "max_queue_delay_microseconds": 2000,
    }
    assert cfgs["sleeper"].instance_count == 2 and cfgs["sleeper"].parameters == {"sleep_ms": "100"}
    assert [s["model_name"] for s in cfgs["pipeline"].ensemble_steps] == ["preprocess", "linear_onnx"]
    assert len(cfgs["accumulator"].sequence_batching["control_input"]) == 4


@pytest.mark.parametrize(
    ("text", "message"),
    [
        (
            'name: "m"\nbackend: "python"\nmax_batch_sise: 4\n',
            r"config.pbtxt:3: unknown field 'max_batch_sise'",
        ),
        (
            'backend: "python"\ninput [ { name: "X" data_type: TYPE_FLOAT dims: [1] } ]',
            r":2: field 'input.data_type'",
        ),
        (
            'backend: "python"\n\noptimization { }\n',
            r":3: field 'optimization' is not supported by tokenmill",
        ),
        ('backend: "python"\nmax_batch_size: "four"\n', r":2: field 'max_batch_size' must be an integer"),
        ('backend: "tensorrt"\n', "backend 'tensorrt' is not supported"),
        ('name: "other"\nbackend: "python"\n', "differs from the directory name"),
        ('backend: "python"\ndynamic_batching { }\n', "needs max_batch_size > 0"),
        ('backend: "python"\ninput [ { name: "X" ', "missing '}'"),
        (
            'backend: "python"\nmax_batch_size: 4\ndynamic_batching { preferred_batch_size: [8] }',
            "larger than max_batch_size",
        ),
        (
            'backend: "python"\nsequence_batching { state [ { input_name: "S" } ] }',
            "'sequence_batching.state' is not",
        ),
    ],
)
def test_config_errors_name_line_and_field(tmp_path, text: str, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        load_config(write(tmp_path, text))


def test_pbtxt_syntax_variants() -> None:
    fields = parse('a: 1 b { c: "x" } d: [1, 2] d: 3 e < f: true > # comment\n g: -1.5e2')
    assert [f.name for f in fields] == ["a", "b", "d", "d", "d", "e", "g"]
    assert fields[-1].value == -150.0


@pytest.mark.parametrize("dt", ["FP32", "INT64", "UINT8", "BOOL", "FP16", "BYTES"])
def test_tensor_round_trips(dt: str) -> None:
    if dt == "BYTES":
        a = np.array([b"ab", b"", "héllo".encode()], dtype=object).reshape(3, 1)
    else:
        a = (np.arange(6) % 2 if dt == "BOOL" else np.arange(6)).astype(dtypes.NUMPY[dt]).reshape(2, 3)
    back = dtypes.from_binary(dtypes.to_binary(a), dt, list(a.shape))
    assert back.shape == a.shape and (back == a).all()
    js = dtypes.from_json(dtypes.to_json(a), dt, list(a.shape))
    assert (js == a).all()
    with pytest.raises(ValueError, match="needs"):
        dtypes.from_json([1, 2, 3], "FP32", [2, 2])


class Recorder(Instance):
    """Records the batch sizes it executes; waits `delay` seconds per execution."""

    def __init__(self, delay: float = 0.0) -> None:
        self.delay, self.batches = delay, []

    def execute(self, reqs):
        self.batches.append(len(reqs))
        time.sleep(self.delay)
        return [{"Y": r.inputs["X"] * 2} for r in reqs]


class Ordered(Instance):
    """Executes one request at a time, 50 ms each, recording the order of request ids."""

    def __init__(self) -> None:
        self.order: list[str] = []

    def execute(self, reqs):
        self.order.append(reqs[0].request_id)
        time.sleep(0.05)
        return [{"Y": r.inputs["X"]} for r in reqs]


def cfg_for(tmp_path, dyn: str, max_batch: int = 8):
    return load_config(
        write(
            tmp_path,
            f'backend: "python"\nmax_batch_size: {max_batch}\n'
            'input [ { name: "X" data_type: TYPE_FP32 dims: [1] } ]\n'
            'output [ { name: "Y" data_type: TYPE_FP32 dims: [1] } ]\n' + dyn,
        )
    )


def req(v: float = 1.0, **kw) -> InferRequest:
    return InferRequest({"X": np.array([[v]], np.float32)}, **kw)


def run(coro):
    return asyncio.run(coro)


def test_dynamic_batcher_prefers_preferred_sizes(tmp_path) -> None:
    cfg = cfg_for(
        tmp_path, "dynamic_batching { preferred_batch_size: [2, 4] max_queue_delay_microseconds: 500000 }"
    )
    inst = Recorder(delay=0.05)

    async def main():
        b = DynamicBatcher(cfg, [inst], ModelStats("m", "1"))
        outs = await asyncio.gather(*(b.submit(req(i)) for i in range(10)))
        await b.close()
        return outs

    outs = run(main())
    assert [float(o["Y"][0, 0]) for o in outs] == [2.0 * i for i in range(10)]
    # 10 requests: batches of the largest preferred size (4, 4), then the 2 left as a preferred 2.
    assert inst.batches == [4, 4, 2]


def test_dynamic_batcher_delay_is_bounded(tmp_path) -> None:
    cfg = cfg_for(
        tmp_path, "dynamic_batching { preferred_batch_size: [4] max_queue_delay_microseconds: 100000 }"
    )
    inst = Recorder()

    async def main():
        b = DynamicBatcher(cfg, [inst], ModelStats("m", "1"))
        t0 = time.perf_counter()
        await asyncio.gather(b.submit(req()), b.submit(req()))  # 2 < preferred 4: waits out the delay
        dt = time.perf_counter() - t0
        await b.close()
        return dt

    dt = run(main())
    # It waited out the delay, and no longer than a bound (a busy machine's slack, not a timing claim).
    assert inst.batches == [2] and 0.09 <= dt < 1.0


def test_queue_policy_rejects_overflow_and_timeouts(tmp_path) -> None:
    cfg = cfg_for(
        tmp_path,
        "dynamic_batching { max_queue_delay_microseconds: 0 default_queue_policy { "
        "max_queue_size: 2 timeout_action: REJECT default_timeout_microseconds: 30000 } }",
        max_batch=1,
    )
    inst = Recorder(delay=0.1)

    async def main():
        b = DynamicBatcher(cfg, [inst], ModelStats("m", "1"))
        tasks = [asyncio.ensure_future(b.submit(req())) for _ in range(4)]
        res = await asyncio.gather(*tasks, return_exceptions=True)
        await b.close()
        return res

    res = run(main())
    errors = [r for r in res if isinstance(r, InferError)]
    assert any("maximum queue size" in e.message for e in errors)
    assert any("timeout" in e.message for e in errors)
    assert all(e.status == 503 for e in errors) and not isinstance(res[0], Exception)


def test_priority_levels_go_first(tmp_path) -> None:
    cfg = cfg_for(tmp_path, "dynamic_batching { priority_levels: 2 default_priority_level: 2 }", max_batch=1)
    inst = Ordered()

    async def main():
        b = DynamicBatcher(cfg, [inst], ModelStats("m", "1"))
        first = asyncio.ensure_future(b.submit(req(request_id="busy")))
        await asyncio.sleep(0.01)
        low = [asyncio.ensure_future(b.submit(req(request_id=f"low{i}"))) for i in range(2)]
        high = asyncio.ensure_future(b.submit(req(request_id="high", priority=1)))
        await asyncio.gather(first, high, *low)
        await b.close()

    run(main())
    assert inst.order == ["busy", "high", "low0", "low1"]


def test_more_instances_raise_throughput(tmp_path) -> None:
    """A second instance executes beside the first (what raises throughput for a model that waits),
    counted by the instances themselves rather than timed: a wall-clock ratio flaked on a busy machine."""
    cfg = cfg_for(tmp_path, "", max_batch=0)
    cfg.max_batch_size = 0

    class Overlap(Recorder):
        running = most = 0
        lock = threading.Lock()

        def execute(self, reqs):
            with Overlap.lock:
                Overlap.running += 1
                Overlap.most = max(Overlap.most, Overlap.running)
            try:
                return super().execute(reqs)
            finally:
                with Overlap.lock:
                    Overlap.running -= 1

    def most_at_once(n: int) -> tuple[int, list[int]]:
        Overlap.running = Overlap.most = 0
        instances = [Overlap(delay=0.05) for _ in range(n)]

        async def main():
            s = DefaultScheduler(cfg, instances, ModelStats("m", "1"))
            outs = await asyncio.gather(
                *(s.submit(InferRequest({"X": np.ones((1,), np.float32)})) for _ in range(8))
            )
            await s.close()
            assert len(outs) == 8

        run(main())
        return Overlap.most, [len(i.batches) for i in instances]

    assert most_at_once(1) == (1, [8])
    most, shares = most_at_once(2)
    assert most == 2 and sum(shares) == 8 and min(shares) >= 1


def test_sequence_batcher_pins_and_orders(tmp_path) -> None:
    text = (
        'backend: "python"\nmax_batch_size: 2\ninput [ { name: "X" data_type: TYPE_FP32 dims: [1] } ]\n'
        'output [ { name: "Y" data_type: TYPE_FP32 dims: [1] } ]\nsequence_batching { control_input [\n'
        '{ name: "START" control [ { kind: CONTROL_SEQUENCE_START int32_false_true: [0, 1] } ] },\n'
        '{ name: "CORRID" control [ { kind: CONTROL_SEQUENCE_CORRID data_type: TYPE_UINT64 } ] } ] }\n'
        "instance_group [ { count: 2 } ]"
    )
    cfg = load_config(write(tmp_path, text))
    seen: dict[int, list] = {0: [], 1: []}

    class Seq(Instance):
        def __init__(self, i):
            self.i = i

        def execute(self, reqs):
            for r in reqs:
                seen[self.i].append(
                    (int(r.inputs["CORRID"][0]), int(r.inputs["START"][0]), float(r.inputs["X"][0, 0]))
                )
            return [{"Y": r.inputs["X"]} for r in reqs]

    async def main():
        b = SequenceBatcher(cfg, [Seq(0), Seq(1)], ModelStats("m", "1"))
        await asyncio.gather(
            *(b.submit(req(v, correlation_id=7, flags=1 if v == 0 else 0)) for v in range(1)),
            *(b.submit(req(v, correlation_id=9, flags=1 if v == 0 else 0)) for v in range(1)),
        )
        for v in range(1, 4):
            await asyncio.gather(b.submit(req(v, correlation_id=7)), b.submit(req(v, correlation_id=9)))
        await b.close()

    run(main())
    # Each sequence stays on one instance, in order, with START only on its first request.
    by_seq = {c: [(s, x) for i in seen for (c2, s, x) in seen[i] if c2 == c] for c in (7, 9)}
    assert by_seq[7] == [(1, 0.0), (0, 1.0), (0, 2.0), (0, 3.0)] and by_seq[9] == by_seq[7]
    assert {c for c, _, _ in seen[0]} != {c for c, _, _ in seen[1]}


def _copy(src: str, dst: Path, name: str | None = None) -> Path:
    import shutil

    target = dst / (name or src)
    shutil.copytree(EXAMPLES / src, target)
    if name:
        cfg = target / "config.pbtxt"
        cfg.write_text(cfg.read_text().replace(f'name: "{src}"', f'name: "{name}"'))
    return target


@pytest.mark.parametrize("kind", ["torchscript", "export"])
def test_pytorch_backend(tmp_path, kind: str) -> None:
    import torch

    from tokenmill.triton.repository import ModelRepository

    d = write(
        tmp_path,
        'platform: "pytorch_libtorch"\nmax_batch_size: 4\n'
        'input [ { name: "A" data_type: TYPE_FP32 dims: [2] },\n'
        '        { name: "B" data_type: TYPE_FP32 dims: [2] } ]\n'
        'output [ { name: "SUM" data_type: TYPE_FP32 dims: [2] },\n'
        '         { name: "DIFF" data_type: TYPE_FP32 dims: [2] } ]\n'
        'default_model_filename: "model.pt2"',
        name="addsub",
    )

    class AddSub(torch.nn.Module):
        def forward(self, a, b):
            return a + b, a - b

    if kind == "torchscript":
        (d / "config.pbtxt").write_text((d / "config.pbtxt").read_text().replace("model.pt2", "model.pt"))
        torch.jit.script(AddSub()).save(str(d / "1" / "model.pt"))
    else:
        batch = torch.export.Dim("batch", max=64)
        ep = torch.export.export(
            AddSub(), (torch.ones(2, 2), torch.ones(2, 2)), dynamic_shapes=({0: batch}, {0: batch})
        )
        torch.export.save(ep, str(d / "1" / "model.pt2"))

    async def main():
        repo = ModelRepository(tmp_path)
        await repo.start()
        a, b = np.array([[1, 2], [3, 4]], np.float32), np.ones((2, 2), np.float32)
        out = await repo.infer("addsub", None, InferRequest({"A": a, "B": b}))
        await repo.close()
        return a, b, out

    a, b, out = run(main())
    np.testing.assert_array_equal(out["SUM"], a + b)
    np.testing.assert_array_equal(out["DIFF"], a - b)


def test_poll_mode_picks_up_changes_and_explicit_rules(tmp_path) -> None:
    from tokenmill.triton.repository import ModelRepository

    _copy("sleeper", tmp_path)

    async def main():
        repo = ModelRepository(tmp_path, mode="poll", poll_secs=3600)
        await repo.start()
        assert [m["name"] for m in repo.index()] == ["sleeper"]
        _copy("preprocess", tmp_path)
        await repo.rescan()  # what the poller does every poll interval
        assert repo.ready("preprocess")
        with pytest.raises(InferError, match="polling"):
            await repo.load("preprocess")
        import shutil

        shutil.rmtree(tmp_path / "sleeper")
        await repo.rescan()
        assert not repo.ready("sleeper")
        await repo.close()

    run(main())


def test_memory_budget_unloads_least_recently_used(tmp_path) -> None:
    from tokenmill.triton.repository import ModelRepository

    for name in ("p1", "p2"):
        d = _copy("preprocess", tmp_path, name)
        (d / "1" / "weights.bin").write_bytes(b"\0" * 600_000)  # ~0.6 MB each

    async def main():
        repo = ModelRepository(tmp_path, mode="explicit", memory_budget_mb=1.0)
        await repo.start()
        await repo.load("p1")
        raw = np.ones((1, 4), np.int32)
        await repo.infer("p1", None, InferRequest({"RAW": raw}))
        await repo.load("p2")  # does not fit beside p1: p1 goes
        states = {m["name"]: m["state"] for m in repo.index()}
        await repo.close()
        return states

    assert run(main()) == {"p1": "UNAVAILABLE", "p2": "READY"}


def _pipeline_repository(tmp_path: Path) -> None:
    """The example pipeline and sleeper, with linear_onnx replaced by a Python model."""
    for n in ("preprocess", "pipeline", "sleeper"):
        _copy(n, tmp_path)
    # A Python stand-in for linear_onnx with the same interface keeps this test free of ONNX files.
    d = write(
        tmp_path,
        'name: "linear_onnx"\nbackend: "python"\nmax_batch_size: 8\n'
        'input [ { name: "X" data_type: TYPE_FP32 dims: [4] } ]\n'
        'output [ { name: "Y" data_type: TYPE_FP32 dims: [2] } ]',
        name="linear_onnx",
    )
    (d / "1" / "model.py").write_text(
        "import numpy as np\nimport triton_python_backend_utils as pb\n"
        "class TritonPythonModel:\n"
        "    def execute(self, requests):\n"
        "        xs = [pb.get_input_tensor_by_name(r, 'X').as_numpy() for r in requests]\n"
        "        return [pb.InferenceResponse([pb.Tensor('Y', x[:, :2])]) for x in xs]\n"
    )


def test_ensemble_loads_and_unloads_its_steps(tmp_path) -> None:
    from tokenmill.triton.repository import ModelRepository

    _pipeline_repository(tmp_path)

    async def main():
        repo = ModelRepository(tmp_path, mode="explicit", load_models=["pipeline"])
        await repo.start()
        ready = {n: repo.ready(n) for n in ("pipeline", "preprocess", "linear_onnx", "sleeper")}
        out = await repo.infer("pipeline", None, InferRequest({"RAW": np.array([[2, 4, 6, 8]], np.int32)}))
        await repo.unload("pipeline", unload_dependents=True)
        after = {n: repo.ready(n) for n in ("pipeline", "preprocess", "linear_onnx")}
        await repo.close()
        return ready, out, after

    ready, out, after = run(main())
    assert ready == {"pipeline": True, "preprocess": True, "linear_onnx": True, "sleeper": False}
    np.testing.assert_array_equal(out["Y"], [[1.0, 2.0]])
    assert after == {"pipeline": False, "preprocess": False, "linear_onnx": False}


def test_ensemble_config_writes_every_step_version(tmp_path) -> None:
    # perf_analyzer reads each step's model_version from the config; left out, the latest (-1) runs.
    d = write(
        tmp_path,
        'platform: "ensemble"\nmax_batch_size: 8\n'
        'input [ { name: "RAW" data_type: TYPE_INT32 dims: [4] } ]\n'
        'output [ { name: "Y" data_type: TYPE_FP32 dims: [4] } ]\n'
        'ensemble_scheduling { step [ { model_name: "preprocess" input_map { key: "RAW" value: "RAW" }\n'
        '  output_map { key: "SCALED" value: "Y" } } ] }',
        name="ens",
    )
    steps = load_config(d).to_json()["ensemble_scheduling"]["step"]
    assert [(s["model_name"], s["model_version"]) for s in steps] == [("preprocess", -1)]


def test_ensemble_statistics_count_its_requests(tmp_path) -> None:
    """An ensemble's own statistics count each request as Triton's do (they stayed at 0 inferences):
    one execution of its batch size, a queue entry, and its steps' compute times added up."""
    from tokenmill.triton.repository import ModelRepository

    _pipeline_repository(tmp_path)

    async def main():
        repo = ModelRepository(tmp_path, mode="explicit", load_models=["pipeline"])
        await repo.start()
        for batch in (2, 2, 3):
            await repo.infer("pipeline", None, InferRequest({"RAW": np.ones((batch, 4), np.int32)}))
        stats = {n: repo.get(n).stats.to_json() for n in ("pipeline", "preprocess", "linear_onnx")}
        await repo.close()
        return stats

    stats = run(main())
    s = stats["pipeline"]
    assert s["inference_count"] == 7 and s["execution_count"] == 3
    assert {k: s["inference_stats"][k]["count"] for k in ("success", "fail", "queue", "compute_infer")} == {
        "success": 3,
        "fail": 0,
        "queue": 3,
        "compute_infer": 3,
    }
    assert [(b["batch_size"], b["compute_infer"]["count"]) for b in s["batch_stats"]] == [(2, 2), (3, 1)]
    # One request at a time: every step's batch is that request alone, so the sums are exact.
    steps = sum(stats[n]["inference_stats"]["compute_infer"]["ns"] for n in ("preprocess", "linear_onnx"))
    assert s["inference_stats"]["compute_infer"]["ns"] == steps > 0
    assert s["last_inference"] > 0


def test_requests_are_served_in_arrival_order(tmp_path) -> None:
    """Clients sending back to back must not starve each other: a client whose request just finished
    may not re-take the instance before the requests already waiting, so four such clients are served
    in turn (checked on the order of execution, not on times, which a busy machine stretches)."""
    cfg = cfg_for(tmp_path, "", max_batch=0)
    order: list[int] = []

    class ByClient(Recorder):
        def execute(self, reqs):
            order.extend(int(r.inputs["X"][0]) for r in reqs)
            return super().execute(reqs)

    async def main():
        s = DefaultScheduler(cfg, [ByClient(delay=0.01)], ModelStats("m", "1"))

        async def client(c: int):
            for _ in range(5):
                await s.submit(InferRequest({"X": np.full((1,), c, np.float32)}))

        await asyncio.gather(*(client(c) for c in range(4)))
        await s.close()

    run(main())
    assert len(order) == 20
    assert all(len(set(order[i : i + 4])) == 4 for i in range(17)), order  # each turn serves all four


def test_delay_action_serves_timed_out_requests_last(tmp_path) -> None:
    cfg = cfg_for(
        tmp_path,
        "dynamic_batching { priority_levels: 2 default_priority_level: 2 "
        "priority_queue_policy { key: 2 value { timeout_action: DELAY "
        "default_timeout_microseconds: 20000 } } }",
        max_batch=1,
    )
    inst = Ordered()

    async def main():
        b = DynamicBatcher(cfg, [inst], ModelStats("m", "1"))
        busy = asyncio.ensure_future(b.submit(req(request_id="busy", priority=1)))
        await asyncio.sleep(0.005)
        late = asyncio.ensure_future(b.submit(req(request_id="delayed")))  # level 2: times out, DELAYed
        await asyncio.sleep(0.03)
        hi = asyncio.ensure_future(b.submit(req(request_id="high", priority=1)))
        res = await asyncio.gather(busy, late, hi)
        await b.close()
        return res

    res = run(main())
    assert inst.order == ["busy", "high", "delayed"] and len(res) == 3  # delayed, not rejected


def test_failed_reload_keeps_the_loaded_model(tmp_path) -> None:
    from tokenmill.triton.repository import ModelRepository

    d = _copy("preprocess", tmp_path)

    async def main():
        repo = ModelRepository(tmp_path, mode="explicit", load_models=["preprocess"])
        await repo.start()
        (d / "config.pbtxt").write_text((d / "config.pbtxt").read_text() + "\nbogus: 1\n")
        with pytest.raises(InferError, match="unknown field 'bogus'"):
            await repo.load("preprocess")
        ok = repo.ready("preprocess")
        await repo.close()
        return ok

    assert run(main())
