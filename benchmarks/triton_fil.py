"""Rows per second of tree models served by the fil backend (Triton FIL's repositories) against the same
library called directly, at batch 1 and batch 1024, in one run and interleaved (absolute times on a shared
2-core machine drift; ratios much less).

- Models, trained here on seeded synthetic data (32 features, binary labels): XGBoost (100 trees, depth
  6, saved as UBJSON), LightGBM (100 trees, 63 leaves, model.txt) and a scikit-learn random forest (100
  trees, depth 8, as a Treelite checkpoint), each served with predict_proba (dims [2]), as FIL's docs
  configure a classifier.
- library: the predictor the backend calls, on one thread as the backend runs by default (XGBoost's
  Booster.inplace_predict, LightGBM's Booster.predict, Treelite's gtil.predict); scikit-learn's own
  predict_proba on the forest is shown beside the checkpoint's figures.
- fil: `FilInstance.execute` on one request of that many rows (what the server's worker thread calls).
- served (unless --no-server): a real `tokenmill serve --model-repository` answering tritonclient over
  HTTP and gRPC, one request at a time (batch 1: the latency a caller sees; batch 1024: one request of
  1024 rows), for the XGBoost model.
- Each figure is the median over --repeats rounds; a round times calls for --seconds. The outputs of
  the backend and the library must agree (checked). foreign_cpu_share: the share of the machine's cores
  that other processes kept busy meanwhile.

    python benchmarks/triton_fil.py [--repeats 5] [--seconds 0.5] [--no-server] [--quick]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import lightgbm
import numpy as np
import treelite
import treelite.gtil
import xgboost
from sklearn.ensemble import RandomForestClassifier

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
from machine import ForeignLoad, cpu_description  # noqa: E402
from results_log import add_flag, record  # noqa: E402
from server_fixture import free_port, running_server  # noqa: E402

from tokenmill.triton.backends import InferRequest, create_instances  # noqa: E402
from tokenmill.triton.config import load_config  # noqa: E402

FEATURES, BATCHES = 32, (1, 1024)
FILES = {"xgboost_ubj": "xgboost.ubj", "lightgbm": "model.txt", "treelite_checkpoint": "checkpoint.tl"}


def config(model_type: str) -> str:
    return (
        f'backend: "fil"\nmax_batch_size: 32768\n'
        f'input [ {{ name: "input__0" data_type: TYPE_FP32 dims: [ {FEATURES} ] }} ]\n'
        f'output [ {{ name: "output__0" data_type: TYPE_FP32 dims: [ 2 ] }} ]\n'
        f"instance_group [{{ kind: KIND_AUTO }}]\n"
        f'parameters [\n  {{ key: "model_type" value: {{ string_value: "{model_type}" }} }},\n'
        f'  {{ key: "output_class" value: {{ string_value: "true" }} }},\n'
        f'  {{ key: "predict_proba" value: {{ string_value: "true" }} }}\n]\n'
        f"dynamic_batching {{}}\n"
    )


def train(repo: Path, x: np.ndarray, y: np.ndarray) -> dict[str, tuple[Callable[[np.ndarray], Any], Any]]:
    """Each model saved in `repo` as <name>/1/<file>; name -> (the library's predictor, sklearn's or None)."""
    for name, model_type in (
        ("xgboost", "xgboost_ubj"),
        ("lightgbm", "lightgbm"),
        ("forest", "treelite_checkpoint"),
    ):
        (repo / name / "1").mkdir(parents=True)
        (repo / name / "config.pbtxt").write_text(config(model_type))
    booster = xgboost.train(
        {"objective": "binary:logistic", "max_depth": 6, "nthread": 1}, xgboost.DMatrix(x, y), 100
    )
    booster.save_model(str(repo / "xgboost" / "1" / FILES["xgboost_ubj"]))
    booster.set_param({"nthread": 1})
    lgb = lightgbm.train(
        {"objective": "binary", "num_leaves": 63, "num_threads": 1, "verbose": -1},
        lightgbm.Dataset(x, y),
        100,
    )
    lgb.save_model(str(repo / "lightgbm" / "1" / FILES["lightgbm"]))
    rf = RandomForestClassifier(n_estimators=100, max_depth=8, random_state=0, n_jobs=1).fit(x, y)
    tl = treelite.sklearn.import_model(rf)
    tl.serialize(str(repo / "forest" / "1" / FILES["treelite_checkpoint"]))
    return {
        "xgboost": (lambda rows: booster.inplace_predict(rows), None),
        "lightgbm": (lambda rows: lgb.predict(rows, num_threads=1), None),
        "forest": (lambda rows: treelite.gtil.predict(tl, rows.astype(np.float64), nthread=1), rf),
    }


def rate(fn: Callable[[np.ndarray], Any], rows: np.ndarray, seconds: float) -> float:
    """Rows per second of calling fn(rows) back to back for about `seconds`."""
    fn(rows)
    calls, t0 = 0, time.perf_counter()
    while (elapsed := time.perf_counter() - t0) < seconds:
        fn(rows)
        calls += 1
    return calls * len(rows) / elapsed


def agree(ours: np.ndarray, theirs: Any) -> float:
    """The largest difference between the backend's [1 - p, p] and the library's P(class 1)."""
    p = np.asarray(theirs, dtype=np.float64).reshape(len(ours), -1)[:, -1]
    return float(np.abs(ours[:, 1] - p).max())


def in_process(repo: Path, models: dict, x: np.ndarray, args: argparse.Namespace) -> dict[str, float]:
    instances = {n: create_instances(load_config(repo / n), repo / n / "1")[0] for n in models}
    times: dict[str, list[float]] = {}
    worst = 0.0
    for _ in range(args.repeats):
        for name, (library, sk) in models.items():
            inst = instances[name]
            for b in BATCHES:
                rows = x[:b]
                fil = lambda r, inst=inst: inst.execute([InferRequest({"input__0": r})])[0]["output__0"]  # noqa: E731
                worst = max(worst, agree(fil(x[:1024]), library(x[:1024])))
                times.setdefault(f"{name}_lib_b{b}", []).append(rate(library, rows, args.seconds))
                times.setdefault(f"{name}_fil_b{b}", []).append(rate(fil, rows, args.seconds))
                if sk is not None:
                    times.setdefault(f"sklearn_b{b}", []).append(rate(sk.predict_proba, rows, args.seconds))
    assert worst < 1e-6, f"the backend and the library disagree by {worst}"
    return {k: statistics.median(v) for k, v in times.items()} | {"worst_abs_diff": worst}


def served(repo: Path, x: np.ndarray, args: argparse.Namespace) -> dict[str, float]:
    import tritonclient.grpc as grpcclient
    import tritonclient.http as httpclient

    grpc_port = free_port()
    times: dict[str, list[float]] = {}
    with running_server("--model-repository", str(repo), "--grpc-port", str(grpc_port)) as srv:
        clients = {
            "http": (httpclient, httpclient.InferenceServerClient(srv.base_url.removeprefix("http://"))),
            "grpc": (grpcclient, grpcclient.InferenceServerClient(f"127.0.0.1:{grpc_port}")),
        }
        for _ in range(args.repeats):
            for proto, (module, client) in clients.items():
                for b in BATCHES:

                    def call(rows: np.ndarray, module: Any = module, client: Any = client) -> np.ndarray:
                        inp = module.InferInput("input__0", list(rows.shape), "FP32")
                        inp.set_data_from_numpy(rows)
                        return client.infer("xgboost", [inp]).as_numpy("output__0")

                    times.setdefault(f"served_{proto}_b{b}", []).append(rate(call, x[:b], args.seconds))
    return {k: statistics.median(v) for k, v in times.items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--seconds", type=float, default=0.5, help="how long each figure's calls run per round")
    ap.add_argument("--no-server", action="store_true", help="skip the served figures (no server start)")
    ap.add_argument("--quick", action="store_true", help="a smoke test: one short round, not recorded")
    add_flag(ap)
    args = ap.parse_args()
    if args.quick:
        args.repeats, args.seconds, args.no_record = 1, 0.1, True
    rng = np.random.default_rng(0)
    x = rng.normal(size=(4096, FEATURES)).astype(np.float32)
    y = (x[:, 0] + x[:, 1] * x[:, 2] - x[:, 3] > 0).astype(int)
    print(f"{cpu_description()}; xgboost {xgboost.__version__}, lightgbm {lightgbm.__version__}, "
          f"treelite {treelite.__version__}; one thread per call")  # fmt: skip
    with tempfile.TemporaryDirectory() as tmp, ForeignLoad() as load:
        repo = Path(tmp)
        models = train(repo, x[:3072], y[:3072])
        med = in_process(repo, models, x[3072:], args)
        if not args.no_server:
            med |= served(repo, x[3072:], args)

    res: dict[str, float | int | str] = {"threads": 1, "features": FEATURES, "trees": 100}
    print(f"\n{'model':10s} {'batch':>6s} {'library rows/s':>15s} {'fil rows/s':>12s} {'fil/library':>12s}")
    for name in ("xgboost", "lightgbm", "forest"):
        for b in BATCHES:
            lib, fil = med[f"{name}_lib_b{b}"], med[f"{name}_fil_b{b}"]
            print(f"{name:10s} {b:6d} {lib:15,.0f} {fil:12,.0f} {fil / lib:12.3f}")
            res[f"{name}_lib_b{b}_rows_per_s"] = round(lib)
            res[f"{name}_fil_b{b}_rows_per_s"] = round(fil)
            res[f"{name}_fil_over_lib_b{b}"] = round(fil / lib, 3)
    for b in BATCHES:  # the goal's figure: the backend's cost on the model type it costs most on
        res[f"worst_fil_over_lib_b{b}"] = min(
            res[f"{n}_fil_over_lib_b{b}"] for n in ("xgboost", "lightgbm", "forest")
        )
    for b in BATCHES:
        res[f"sklearn_b{b}_rows_per_s"] = round(med[f"sklearn_b{b}"])
        print(
            f"{'sklearn':10s} {b:6d} {med[f'sklearn_b{b}']:15,.0f}   (RandomForestClassifier.predict_proba)"
        )
    if not args.no_server:
        print(
            f"\n{'served':10s} {'batch':>6s} {'rows/s':>15s} {'/ library':>12s}"
            "   (xgboost, one request at a time)"
        )
        for proto in ("http", "grpc"):
            for b in BATCHES:
                v = med[f"served_{proto}_b{b}"]
                print(f"{proto:10s} {b:6d} {v:15,.0f} {v / med[f'xgboost_lib_b{b}']:12.3f}")
                res[f"served_{proto}_b{b}_rows_per_s"] = round(v)
                res[f"served_{proto}_over_lib_b{b}"] = round(v / med[f"xgboost_lib_b{b}"], 3)
    res["worst_abs_diff"] = med["worst_abs_diff"]
    res["foreign_cpu_share"] = round(load.share, 3)
    print(f"\nworst |fil - library| {med['worst_abs_diff']:.2e}; other processes kept "
          f"{load.share:.0%} of the cores busy")  # fmt: skip
    record("triton_fil", res, args=args)


if __name__ == "__main__":
    main()
