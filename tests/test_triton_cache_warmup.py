"""Triton's response cache and model warmup: the pieces on their own, then on a real server.

The `slow` tests start `tokenmill serve --model-repository ... --cache-config local,size=N` and talk to
it with the official tritonclient; run the others alone with `-m "not slow"`.
"""

from __future__ import annotations

import asyncio
import json
import threading
from pathlib import Path

import httpx
import numpy as np
import pytest
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from tokenmill.triton.backends import Instance, ModelError
from tokenmill.triton.config import load_config
from tokenmill.triton.decoupled import StreamItem
from tokenmill.triton.pbtxt import ConfigError
from tokenmill.triton.response_cache import (
    ENTRY_OVERHEAD,
    ResponseCache,
    check_cacheable,
    make_key,
    parse_cache_config,
)
from tokenmill.triton.scheduling import DefaultScheduler, DynamicBatcher
from tokenmill.triton.stats import ModelStats, TritonMetrics
from tokenmill.triton.warmup import run_warmup, warmup_requests

tritonclient_utils = pytest.importorskip("tritonclient.utils", reason="tritonclient is a dev dependency")


def write_model(root: Path, name: str, config: str, model_py: str | None = None) -> Path:
    d = root / name
    (d / "1").mkdir(parents=True, exist_ok=True)
    (d / "config.pbtxt").write_text(f'name: "{name}"\n' + config)
    if model_py is not None:
        (d / "1" / "model.py").write_text(model_py)
    return d


X4 = (
    'input [ { name: "X" data_type: TYPE_FP32 dims: [4] } ]\n'
    'output [ { name: "Y" data_type: TYPE_FP32 dims: [4] } ]\n'
)


def metric_samples(registry: CollectorRegistry) -> dict[tuple[str, tuple], float]:
    """(sample name, sorted labels) -> value, read back with prometheus_client's own text parser."""
    text = generate_latest(registry).decode()
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for fam in text_string_to_metric_families(text)
        for s in fam.samples
    }


# --- the cache ----------------------------------------------------------------------------------------


def key(x: np.ndarray, **kw):
    args = {"model": "m", "version": "1", "inputs": {"X": x}, "requested_outputs": None, "parameters": None}
    args.update(kw)
    return make_key(
        args["model"], args["version"], args["inputs"], args["requested_outputs"], args["parameters"]
    )


def test_hit_returns_what_was_stored_and_miss_returns_none() -> None:
    cache = ResponseCache(1 << 20)
    x = np.arange(8, dtype=np.float32)
    y = {"Y": x * 2, "S": np.array([b"a", b"bc"], dtype=object)}
    assert cache.lookup(key(x)) is None
    assert cache.insert(key(x), y)
    got = cache.lookup(key(x.copy()))  # an equal request, in new arrays
    assert got is not None and list(got) == ["Y", "S"]
    np.testing.assert_array_equal(got["Y"], x * 2)
    assert got["Y"].dtype == np.float32 and list(got["S"]) == [b"a", b"bc"]
    assert cache.lookup(key(x + 1)) is None
    assert (cache.hits, cache.misses, len(cache)) == (1, 2, 1)


def test_different_requests_never_share_an_entry() -> None:
    x = np.arange(4, dtype=np.int32)
    variants = [
        key(x),
        key(x.view(np.float32)),  # the same bytes, another datatype
        key(x.reshape(2, 2)),  # the same bytes, another shape
        key(x + 1),
        key(x, inputs={"X2": x}),  # another input name
        key(x, inputs={"X": x, "Z": x}),
        key(x, model="m2"),
        key(x, version="2"),
        key(x, requested_outputs=["Y"]),
        key(x, requested_outputs=[]),
        key(x, parameters={"temperature": 1}),
        key(x, inputs={"X": np.array([b"ab", b"c"], dtype=object)}),
        key(x, inputs={"X": np.array([b"a", b"bc"], dtype=object)}),  # the same bytes, split elsewhere
        key(x, inputs={"X": np.array([b"abc"], dtype=object)}),
        key(x, inputs={"X": np.array([], dtype=np.int32)}),
        key(x, inputs={"X": np.zeros((0, 4), dtype=np.int32)}),
    ]
    assert len({k.digest for k in variants}) == len(variants)
    assert all(len(k.digest) >= 16 for k in variants)
    # ... while what cannot change the outputs does not change the key.
    assert key(x).digest == key(x.copy()).digest == key(x, parameters={"priority": 2, "timeout": 5}).digest
    a, b = np.ones(3, np.float32), np.zeros(2, np.int64)
    assert key(a, inputs={"A": a, "B": b}).digest == key(a, inputs={"B": b, "A": a}).digest


def test_least_recently_used_entry_goes_first() -> None:
    arr = np.zeros(1000, np.uint8)
    one = arr.nbytes + len("Y") + key(arr).nbytes + ENTRY_OVERHEAD  # what an entry weighs
    cache = ResponseCache(3 * one)
    keys = [key(np.array([i], np.int32)) for i in range(4)]
    for k in keys[:3]:
        assert cache.insert(k, {"Y": arr})
    assert cache.lookup(keys[0]) is not None  # now the most recently used
    assert cache.insert(keys[3], {"Y": arr})
    assert cache.lookup(keys[1]) is None  # the least recently used went
    assert all(cache.lookup(k) is not None for k in (keys[0], keys[2], keys[3]))
    assert cache.evictions == 1 and cache.used <= cache.capacity


def test_memory_stays_within_size_with_many_entries() -> None:
    rng = np.random.default_rng(0)
    cache = ResponseCache(200_000)
    stored: dict[bytes, int] = {}
    for i in range(2000):
        y = rng.random(int(rng.integers(1, 3000)), dtype=np.float32)
        k = key(np.array([i], np.int64))
        if cache.insert(k, {"Y": y}):
            stored[k.digest] = y.nbytes
        assert cache.used <= cache.capacity
    present = [d for d in stored if d in cache._entries]
    # Every entry still held counts at least its array's bytes (numpy's nbytes).
    assert cache.used >= sum(stored[d] for d in present) and len(present) == len(cache) > 10
    assert cache.evictions == len(stored) - len(present)


def test_entry_larger_than_the_cache_is_not_stored() -> None:
    cache = ResponseCache(10_000)
    small = key(np.array([1], np.int32))
    assert cache.insert(small, {"Y": np.zeros(10, np.float32)})
    big = key(np.array([2], np.int32))
    assert not cache.insert(big, {"Y": np.zeros(10_000, np.float32)})
    assert cache.lookup(big) is None and cache.lookup(small) is not None and cache.evictions == 0


def test_stored_outputs_are_copies_both_ways() -> None:
    cache = ResponseCache(1 << 20)
    y = np.arange(4, dtype=np.float32)
    s = np.empty(1, dtype=object)
    s[0] = bytearray(b"ab")  # a mutable BYTES element (a Python model may return one)
    k = key(y)
    cache.insert(k, {"Y": y, "S": s})
    y[:] = -1  # the caller's arrays change after insertion
    s[0][0] = ord("z")
    got = cache.lookup(k)
    np.testing.assert_array_equal(got["Y"], np.arange(4, dtype=np.float32))
    assert bytes(got["S"][0]) == b"ab"
    got["Y"][:] = 7  # and a reader changes what it got
    got["S"][0][0] = ord("q")
    again = cache.lookup(k)
    np.testing.assert_array_equal(again["Y"], np.arange(4, dtype=np.float32))
    assert bytes(again["S"][0]) == b"ab"


def test_threads_share_the_cache_safely() -> None:
    cache = ResponseCache(50_000)
    errors: list[BaseException] = []

    def work(seed: int) -> None:
        try:
            rng = np.random.default_rng(seed)
            for _ in range(300):
                x = np.array([int(rng.integers(0, 50))], np.int32)
                k = key(x)
                got = cache.lookup(k)
                if got is None:
                    cache.insert(k, {"Y": np.full(int(x[0]) * 20 + 1, x[0], np.int32)})
                else:  # whatever a thread reads is the entry of its own key
                    assert (got["Y"] == x[0]).all() and got["Y"].size == x[0] * 20 + 1
        except BaseException as e:  # noqa: BLE001 (reported by the test thread)
            errors.append(e)

    threads = [threading.Thread(target=work, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    assert cache.used == sum(e.size for e in cache._entries.values()) <= cache.capacity
    assert cache.hits + cache.misses == 1200


def test_evict_models_drops_only_theirs() -> None:
    cache = ResponseCache(1 << 20)
    x = np.ones(2, np.float32)
    cache.insert(key(x, model="a"), {"Y": x})
    cache.insert(key(x, model="a", version="2"), {"Y": x})
    cache.insert(key(x, model="b"), {"Y": x})
    assert cache.evict_models(["a"]) == 2
    assert cache.lookup(key(x, model="b")) is not None and len(cache) == 1
    assert cache.used == sum(e.size for e in cache._entries.values())


@pytest.mark.parametrize(
    ("values", "size"),
    [([], None), (["local,size=1048576"], 1048576), (["local,size=1", "local,size=2"], 2)],
)
def test_cache_config_flag(values, size) -> None:
    assert parse_cache_config(values) == size


@pytest.mark.parametrize(
    ("value", "match"),
    [
        ("redis,host=localhost", "only the in-process 'local' cache"),
        ("memcached,size=10", "only the in-process 'local' cache"),
        ("size=10", "only the in-process 'local' cache"),
        ("local,size=512MB", "positive number of bytes"),
        ("local,size=0", "positive number of bytes"),
        ("local,size=-5", "positive number of bytes"),
        ("local,capacity=10", "unknown setting 'capacity'"),
        ("local", "local,size=<bytes>"),
        ("local,size", "local,size=<bytes>"),
    ],
)
def test_cache_config_flag_errors(value: str, match: str) -> None:
    with pytest.raises(ValueError, match=match) as e:
        parse_cache_config([value])
    assert "\n" not in str(e.value)


def test_models_that_cannot_be_cached_are_refused(tmp_path) -> None:
    cached = "response_cache { enable: true }\n"
    plain = load_config(write_model(tmp_path, "plain", 'backend: "python"\n' + X4 + cached))
    assert check_cacheable(plain) is None
    off = load_config(write_model(tmp_path, "off", 'backend: "python"\n' + X4))
    assert check_cacheable(off) is None  # it does not ask for the cache
    dec = load_config(
        write_model(
            tmp_path,
            "dec",
            'backend: "python"\n' + X4 + cached + "model_transaction_policy { decoupled: true }\n",
        )
    )
    assert "decoupled" in check_cacheable(dec)
    seq = load_config(
        write_model(
            tmp_path,
            "seq",
            'backend: "python"\nmax_batch_size: 2\n' + X4 + cached + "sequence_batching { }\n",
        )
    )
    assert "sequence batcher" in check_cacheable(seq)
    ens = load_config(
        write_model(
            tmp_path,
            "ens",
            'platform: "ensemble"\n' + X4 + cached + 'ensemble_scheduling { step [ { model_name: "dec" '
            'input_map { key: "X" value: "X" } output_map { key: "Y" value: "Y" } } ] }\n',
        )
    )
    assert check_cacheable(ens, [plain]) is None
    assert "composing model (dec)" in check_cacheable(ens, [dec])


def test_model_statistics_and_metrics_count_hits_and_misses() -> None:
    registry = CollectorRegistry()
    metrics = TritonMetrics(registry)
    stats = ModelStats("m", "1", metrics)
    stats.cache_miss(3000)
    stats.finished(True, 10_000)
    stats.cache_hit(500, 2000)
    stats.finished(True, 4000)
    inf = stats.to_json()["inference_stats"]
    assert inf["cache_hit"] == {"count": 1, "ns": 2000} and inf["cache_miss"] == {"count": 1, "ns": 3000}
    assert inf["success"]["count"] == 2 and stats.to_json()["inference_count"] == 0  # hits are no inferences
    cache = ResponseCache(1000)
    metrics.watch_cache(cache)
    cache.insert(key(np.zeros(1)), {"Y": np.zeros(1)})
    m = metric_samples(registry)
    lv = (("model", "m"), ("version", "1"))
    assert m[("nv_cache_num_hits_per_model_total", lv)] == 1
    assert m[("nv_cache_num_misses_per_model_total", lv)] == 1
    assert m[("nv_cache_hit_duration_per_model_total", lv)] == pytest.approx(2.0)  # microseconds
    assert m[("nv_cache_miss_duration_per_model_total", lv)] == pytest.approx(3.0)
    assert m[("nv_cache_num_entries", ())] == 1 and 0 < m[("nv_cache_util", ())] <= 1


# --- warmup requests -----------------------------------------------------------------------------------


def warm_cfg(tmp_path: Path, warmup: str, max_batch: int = 4, extra: str = "", inputs: str | None = None):
    inputs = inputs or (
        'input [ { name: "X" data_type: TYPE_FP32 dims: [2, 3] },\n'
        '        { name: "S" data_type: TYPE_STRING dims: [2] },\n'
        '        { name: "K" data_type: TYPE_INT64 dims: [-1] optional: true } ]\n'
    )
    d = write_model(
        tmp_path,
        "w",
        f'backend: "python"\nmax_batch_size: {max_batch}\n{inputs}'
        'output [ { name: "Y" data_type: TYPE_FP32 dims: [1] } ]\n' + extra + f"model_warmup [ {warmup} ]\n",
    )
    return load_config(d), d


def sample(
    name: str = "s", batch: str = "batch_size: 3", count: str = "", x: str = "zero_data: true", s=None
):
    s = s or "zero_data: true"
    return (
        f'{{ name: "{name}" {batch} {count}\n'
        f'  inputs {{ key: "X" value: {{ data_type: TYPE_FP32 dims: [2, 3] {x} }} }}\n'
        f'  inputs {{ key: "S" value: {{ data_type: TYPE_STRING dims: [2] {s} }} }} }}'
    )


def test_zero_data_with_batch_and_count(tmp_path) -> None:
    cfg, d = warm_cfg(tmp_path, sample(count="count: 2") + ", " + sample("t", batch="", count="count: 0"))
    (name, req, times), (name2, req2, times2) = warmup_requests(cfg, d)
    assert (name, times, name2, times2) == ("s", 2, "t", 1)  # count 0 (the default) runs once
    np.testing.assert_array_equal(req.inputs["X"], np.zeros((3, 2, 3), np.float32))
    assert req.inputs["X"].dtype == np.float32 and "K" not in req.inputs  # optional: left out
    assert req.inputs["S"].shape == (3, 2) and all(v == b"" for v in req.inputs["S"].reshape(-1))
    assert req2.inputs["X"].shape == (1, 2, 3)  # batch_size absent: 1


def test_random_data_is_seeded_and_in_range(tmp_path) -> None:
    extra_input = (
        'input [ { name: "X" data_type: TYPE_FP32 dims: [2, 3] },\n'
        '        { name: "S" data_type: TYPE_STRING dims: [2] },\n'
        '        { name: "I" data_type: TYPE_INT8 dims: [64] } ]\n'
    )
    w = sample(x="random_data: true", s="random_data: true")
    w = w[:-1] + ' inputs { key: "I" value: { data_type: TYPE_INT8 dims: [64] random_data: true } } }'
    cfg, d = warm_cfg(tmp_path, w, inputs=extra_input)
    (_, a, _), (_, b, _) = warmup_requests(cfg, d)[0], warmup_requests(cfg, d)[0]
    for n in ("X", "I"):
        np.testing.assert_array_equal(a.inputs[n], b.inputs[n])  # the same data at every load
    x = a.inputs["X"]
    assert x.shape == (3, 2, 3) and np.isfinite(x).all() and (x >= 0).all() and (x < 1).all() and x.std() > 0
    np.testing.assert_array_equal(x[0], x[2])  # one element, copied along the batch (as Triton)
    assert a.inputs["I"].dtype == np.int8 and len(np.unique(a.inputs["I"])) > 8
    assert all(v == b"" for v in a.inputs["S"].reshape(-1))  # as Triton: random strings are empty ones


def test_input_data_files(tmp_path) -> None:
    x = np.arange(6, dtype=np.float32).reshape(2, 3) / 7
    s = np.array([b"hello", "wörld".encode()], dtype=object)
    cfg, d = warm_cfg(tmp_path, sample(x='input_data_file: "x.bin"', s='input_data_file: "sub/s.bin"'))
    (d / "warmup" / "sub").mkdir(parents=True)
    (d / "warmup" / "x.bin").write_bytes(x.astype("<f4").tobytes())
    # The official client's serialization of a BYTES tensor: what Triton's docs ask the file to hold.
    (d / "warmup" / "sub" / "s.bin").write_bytes(tritonclient_utils.serialize_byte_tensor(s).item())
    [(_, req, _)] = warmup_requests(cfg, d)
    np.testing.assert_array_equal(req.inputs["X"], np.stack([x, x, x]))
    assert req.inputs["S"].shape == (3, 2) and list(req.inputs["S"][1]) == list(s)


@pytest.mark.parametrize(
    ("data", "match"),
    [
        (np.zeros(5, "<f4").tobytes(), "has 20 bytes, dims \\[2, 3\\] of FP32 need exactly 24"),
        (np.zeros(7, "<f4").tobytes(), "has 28 bytes"),
        (None, "cannot read warmup/x.bin"),
    ],
)
def test_data_file_of_the_wrong_size_or_missing(tmp_path, data, match) -> None:
    cfg, d = warm_cfg(tmp_path, sample("bad", x='input_data_file: "x.bin"'))
    if data is not None:
        (d / "warmup").mkdir()
        (d / "warmup" / "x.bin").write_bytes(data)
    with pytest.raises(ModelError, match=f"^w: warmup sample 'bad': input 'X': .*{match}") as e:
        warmup_requests(cfg, d)
    assert "\n" not in str(e.value)


@pytest.mark.parametrize("name", ["../config.pbtxt", "/etc/hostname", "sub/../../config.pbtxt"])
def test_data_file_must_stay_in_the_warmup_folder(tmp_path, name) -> None:
    cfg, d = warm_cfg(tmp_path, sample(x=f'input_data_file: "{name}"'))
    (d / "warmup" / "sub").mkdir(parents=True)
    with pytest.raises(ModelError, match="must be a file inside warmup/"):
        warmup_requests(cfg, d)


def test_strings_file_must_hold_the_right_number_of_strings(tmp_path) -> None:
    cfg, d = warm_cfg(tmp_path, sample(s='input_data_file: "s.bin"'))
    (d / "warmup").mkdir()
    one = np.array([b"only"], dtype=object)
    (d / "warmup" / "s.bin").write_bytes(tritonclient_utils.serialize_byte_tensor(one).item())
    with pytest.raises(ModelError, match="holds 1 strings, dims \\[2\\] need 2"):
        warmup_requests(cfg, d)
    (d / "warmup" / "s.bin").write_bytes(b"\x09\x00\x00\x00abc")
    with pytest.raises(ModelError, match="input 'S'"):
        warmup_requests(cfg, d)


ONLY_X = '{ name: "only_x" inputs { key: "X" value: { data_type: TYPE_FP32 dims: [2, 3] zero_data: true } } }'


@pytest.mark.parametrize(
    ("warmup", "match"),
    [
        (sample(batch="batch_size: 5"), "batch_size 5 exceeds max_batch_size 4"),
        (sample(batch="batch_size: 0"), "batch_size must be at least 1"),
        (sample().replace('key: "S"', 'key: "T"'), "'T' is not an input of the model"),
        (sample().replace('dims: [2] zero_data', 'dims: [3] zero_data'), "'S' has dims \\[3\\]"),
        (sample().replace("TYPE_STRING dims", "TYPE_INT32 dims"),
         "'S' is TYPE_INT32, but the model declares TYPE_STRING"),
        (sample().replace("TYPE_FP32 dims", "TYPE_BF16 dims"), "'X' needs a supported data_type"),
        (sample(x="zero_data: true random_data: true"), "needs one of zero_data"),
        (sample(x=""), "needs one of zero_data"),
        (sample(x="zero_data: false"), "needs one of zero_data"),
        (ONLY_X, "required input 'S' is missing"),
        (sample()[:-1] + ' inputs { key: "K" value: { data_type: TYPE_INT64 dims: [-1] zero_data: true } } }',
         "dims must be given in full"),
    ],
)  # fmt: skip
def test_samples_that_do_not_fit_the_model(tmp_path, warmup, match) -> None:
    cfg, d = warm_cfg(tmp_path, warmup)
    with pytest.raises(ConfigError, match=match) as e:
        warmup_requests(cfg, d)
    assert str(e.value).startswith("w: warmup sample ") and "\n" not in str(e.value)


def test_batch_size_of_a_model_without_batching(tmp_path) -> None:
    cfg, d = warm_cfg(tmp_path, sample(batch="batch_size: 2"), max_batch=0)
    with pytest.raises(ConfigError, match="batch_size must be 1 for a model without batching"):
        warmup_requests(cfg, d)
    cfg, d = warm_cfg(tmp_path, sample(batch="batch_size: 1"), max_batch=0)
    [(_, req, _)] = warmup_requests(cfg, d)
    assert req.inputs["X"].shape == (2, 3) and req.inputs["S"].shape == (2,)  # no batch dimension


def test_sequence_model_sample_may_set_control_inputs(tmp_path) -> None:
    controls = (
        'sequence_batching { control_input [ { name: "START" control [ { kind: CONTROL_SEQUENCE_START '
        "int32_false_true: [0, 1] } ] } ] }\n"
    )
    w = (
        sample()[:-1]
        + ' inputs { key: "START" value: { data_type: TYPE_INT32 dims: [1] zero_data: true } } }'
    )
    cfg, d = warm_cfg(tmp_path, w, extra=controls)
    [(_, req, _)] = warmup_requests(cfg, d)
    assert req.inputs["START"].dtype == np.int32 and req.inputs["START"].shape == (1,)
    bad = w.replace("TYPE_INT32 dims: [1]", "TYPE_FP32 dims: [1]")
    cfg, d = warm_cfg(tmp_path, bad, extra=controls)
    with pytest.raises(ConfigError, match="'START' is TYPE_FP32, but the model declares TYPE_INT32"):
        warmup_requests(cfg, d)


# --- running warmup ------------------------------------------------------------------------------------


class Logger(Instance):
    """Records the X shapes it executes; fails when `fail` is set."""

    def __init__(self, log: list, tag: int, fail: bool = False) -> None:
        self.log, self.tag, self.fail = log, tag, fail

    def execute(self, reqs):
        for r in reqs:
            self.log.append((self.tag, r.request_id, r.inputs["X"].shape))
            r.inputs["X"][...] = 9  # a model that writes into its inputs must not change the next run's
        if self.fail:
            return [ValueError("no good") for _ in reqs]
        return [{"Y": np.zeros((r.inputs["X"].shape[0], 1), np.float32)} for r in reqs]


def test_every_instance_runs_every_sample_count_times_uncounted(tmp_path) -> None:
    cfg, d = warm_cfg(tmp_path, sample(count="count: 2") + ", " + sample("t", batch="batch_size: 1"))
    samples = warmup_requests(cfg, d)
    log: list = []
    stats = ModelStats("w", "1")

    async def main():
        sched = DynamicBatcher(cfg, [Logger(log, 0), Logger(log, 1)], stats)
        await run_warmup(cfg, sched, samples)
        assert sched.stats is stats
        await sched.close()

    asyncio.run(main())
    per_instance = [("warmup:s", (3, 2, 3))] * 2 + [("warmup:t", (1, 2, 3))]
    assert log == [(0, *e) for e in per_instance] + [(1, *e) for e in per_instance]
    assert stats.execution_count == 0 and stats.to_json()["inference_stats"]["queue"]["count"] == 0
    assert (samples[0][1].inputs["X"] == 0).all()  # the sample itself is untouched


def test_a_failing_sample_fails_with_its_name(tmp_path) -> None:
    cfg, d = warm_cfg(tmp_path, sample("zero sample"))

    async def main():
        sched = DefaultScheduler(cfg, [Logger([], 0, fail=True)], ModelStats("w", "1"))
        try:
            await run_warmup(cfg, sched, warmup_requests(cfg, d))
        finally:
            await sched.close()

    with pytest.raises(ModelError, match="^w: warmup sample 'zero sample' failed: .*no good"):
        asyncio.run(main())


class DecoupledFailure(Instance):
    def execute(self, reqs):
        for r in reqs:
            r.stream.send(StreamItem(error="decoupled no good", final=True))
        return [{} for _ in reqs]


def test_a_decoupled_model_failing_in_its_stream_fails_the_warmup(tmp_path) -> None:
    cfg, d = warm_cfg(tmp_path, sample("dec"), extra="model_transaction_policy { decoupled: true }\n")

    async def main():
        sched = DefaultScheduler(cfg, [DecoupledFailure()], ModelStats("w", "1"))
        try:
            await run_warmup(cfg, sched, warmup_requests(cfg, d))
        finally:
            await sched.close()

    with pytest.raises(ModelError, match="warmup sample 'dec' failed: decoupled no good"):
        asyncio.run(main())


# --- on a real server (needs the repository's wiring: --cache-config, warmup at load) ---------------------

COUNTING_MODEL = """
import json
import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def initialize(self, args):
        self.log = json.loads(args["model_config"])["parameters"]["log"]["string_value"]

    def execute(self, requests):
        out = []
        for r in requests:
            x = pb_utils.get_input_tensor_by_name(r, "X").as_numpy()
            with open(self.log, "a") as f:
                f.write(json.dumps({"shape": list(x.shape), "sum": float(x.sum())}) + "\\n")
            if (x < 0).any():
                out.append(pb_utils.InferenceResponse(error=pb_utils.TritonError("An Error Occurred")))
            else:
                out.append(pb_utils.InferenceResponse([pb_utils.Tensor("Y", (x * 2).astype(np.float32))]))
        return out
"""


def log_param(path: Path) -> str:
    return f'parameters [ {{ key: "log" value: {{ string_value: "{path}" }} }} ]\n'


def calls(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    from server_fixture import running_server

    root = tmp_path_factory.mktemp("cache_warmup")
    repo = root / "models"
    logs = {n: root / f"{n}.jsonl" for n in ("cached", "warm", "warm_fail")}
    write_model(repo, "cached", 'backend: "python"\nmax_batch_size: 8\n' + X4.replace("[4]", "[3]")
                + "dynamic_batching { }\nresponse_cache { enable: true }\n" + log_param(logs["cached"]),
                COUNTING_MODEL)  # fmt: skip
    warm = write_model(
        repo,
        "warm",
        'backend: "python"\nmax_batch_size: 4\n' + X4 + log_param(logs["warm"]) + "model_warmup [\n"
        '  { name: "zeros" batch_size: 2 count: 3\n'
        '    inputs { key: "X" value: { data_type: TYPE_FP32 dims: [4] zero_data: true } } },\n'
        '  { name: "from file" batch_size: 1\n'
        '    inputs { key: "X" value: { data_type: TYPE_FP32 dims: [4] input_data_file: "x.bin" } } } ]\n',
        COUNTING_MODEL,
    )
    (warm / "warmup").mkdir()
    (warm / "warmup" / "x.bin").write_bytes(np.array([1, 2, 3, 4], "<f4").tobytes())
    write_model(
        repo,
        "warm_fail",
        'backend: "python"\nmax_batch_size: 0\n' + X4 + log_param(logs["warm_fail"]) + "model_warmup [\n"
        '  { name: "negative"\n'
        '    inputs { key: "X" value: { data_type: TYPE_FP32 dims: [4] input_data_file: "neg" } } } ]\n',
        COUNTING_MODEL,
    )
    (repo / "warm_fail" / "warmup").mkdir()
    (repo / "warm_fail" / "warmup" / "neg").write_bytes(np.full(4, -1, "<f4").tobytes())
    write_model(
        repo,
        "cached_decoupled",
        'backend: "python"\n'
        + X4
        + "response_cache { enable: true }\nmodel_transaction_policy { decoupled: true }\n",
        COUNTING_MODEL,
    )
    with running_server(
        "--model-repository", str(repo), "--model-control-mode", "explicit", "--load-model", "*",
        "--grpc-port", "0", "--cache-config", "local,size=1048576",
    ) as proc:  # fmt: skip
        proc.logs = logs
        yield proc


@pytest.fixture(scope="module")
def client(served):
    import tritonclient.http as httpclient

    return httpclient.InferenceServerClient(served.base_url.removeprefix("http://"))


def infer(client, model: str, x: np.ndarray):
    import tritonclient.http as httpclient

    inp = httpclient.InferInput("X", list(x.shape), "FP32")
    inp.set_data_from_numpy(x)
    return client.infer(model, [inp]).as_numpy("Y")


@pytest.mark.slow
def test_server_second_identical_request_comes_from_the_cache(served, client) -> None:
    log = served.logs["cached"]
    x = np.array([[1, 2, 3]], np.float32)
    np.testing.assert_array_equal(infer(client, "cached", x), x * 2)
    assert len(calls(log)) == 1
    np.testing.assert_array_equal(infer(client, "cached", x.copy()), x * 2)
    assert len(calls(log)) == 1  # the model did not run again
    s = client.get_inference_statistics("cached")["model_stats"][0]
    inf = s["inference_stats"]
    assert inf["cache_hit"]["count"] == 1 and inf["cache_miss"]["count"] == 1
    assert inf["success"]["count"] == 2 and s["execution_count"] == 1 and s["inference_count"] == 1
    y = np.array([[1, 2, 4]], np.float32)
    np.testing.assert_array_equal(infer(client, "cached", y), y * 2)
    assert len(calls(log)) == 2  # a different input runs the model
    text = httpx.get(f"{served.base_url}/metrics").text
    samples = {
        (s.name, s.labels.get("model")): s.value
        for fam in text_string_to_metric_families(text)
        for s in fam.samples
    }
    assert samples[("nv_cache_num_hits_per_model_total", "cached")] == 1
    assert samples[("nv_cache_num_misses_per_model_total", "cached")] == 2
    assert samples[("nv_cache_hit_duration_per_model_total", "cached")] > 0
    assert samples[("nv_cache_miss_duration_per_model_total", "cached")] > 0


@pytest.mark.slow
def test_server_failed_request_is_not_cached(served, client) -> None:
    from tritonclient.utils import InferenceServerException

    log = served.logs["cached"]
    before = len(calls(log))
    x = np.array([[-1, 0, 0]], np.float32)
    for _ in range(2):
        with pytest.raises(InferenceServerException, match="An Error Occurred"):
            infer(client, "cached", x)
    assert len(calls(log)) == before + 2


@pytest.mark.slow
def test_server_warmup_ran_before_ready(served, client) -> None:
    assert client.is_model_ready("warm")
    ran = calls(served.logs["warm"])
    assert ran == [{"shape": [2, 4], "sum": 0.0}] * 3 + [{"shape": [1, 4], "sum": 10.0}]
    s = client.get_inference_statistics("warm")["model_stats"][0]
    assert s["execution_count"] == 0  # warmup runs are not requests


@pytest.mark.slow
def test_server_failed_warmup_or_uncacheable_model_fails_the_load(served, client) -> None:
    index = {m["name"]: m for m in client.get_model_repository_index()}
    assert not client.is_model_ready("warm_fail") and index["warm_fail"]["state"] == "UNAVAILABLE"
    assert "warmup sample 'negative' failed" in index["warm_fail"]["reason"]
    assert "An Error Occurred" in index["warm_fail"]["reason"]
    assert not client.is_model_ready("cached_decoupled")
    assert "does not support decoupled" in index["cached_decoupled"]["reason"]
