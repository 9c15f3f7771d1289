"""The fil backend (Triton FIL's tree models): each format's predictions through the backend, several
requests merged into one batch, against the training library's own predict / predict_proba; load errors;
and one real server answering tritonclient over HTTP and gRPC with dynamic batching."""

from __future__ import annotations

import asyncio
import shutil
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from typing import Any

import numpy as np
import pytest

xgb = pytest.importorskip("xgboost", reason="the fil extra")
lgb = pytest.importorskip("lightgbm", reason="the fil extra")
treelite = pytest.importorskip("treelite", reason="the fil extra")
ensemble = pytest.importorskip("sklearn.ensemble", reason="the fil extra")

from tokenmill.triton.backends import InferRequest, ModelError, create_instances  # noqa: E402
from tokenmill.triton.config import load_config  # noqa: E402
from tokenmill.triton.fil import MODEL_FILES  # noqa: E402
from tokenmill.triton.repository import ModelRepository  # noqa: E402

FEATURES = 6
rng = np.random.default_rng(0)
X = rng.normal(size=(400, FEATURES)).astype(np.float32)
TRAIN, TEST = X[:300], X[300:]
Y_BINARY = (X[:, 0] + X[:, 1] * X[:, 2] > 0).astype(int)
Y_MULTI = np.digitize(X[:, 0] + 0.5 * X[:, 3], [-0.6, 0.6])  # 3 classes
Y_REG = (np.sin(X[:, 0]) + X[:, 1] * X[:, 2]).astype(np.float32)
SMALL = {"n_estimators": 12, "max_depth": 3}


def fil_config(features: int, out_dims: int, model_type: str, classifier: bool, **params: str) -> str:
    """config.pbtxt as a FIL user writes it, GPU tuning included (accepted, and ignored on a CPU)."""
    params = {
        "model_type": model_type,
        "output_class": str(classifier).lower(),
        "storage_type": "AUTO",
        "threads_per_tree": "4",
        **params,
    }
    listed = ",\n".join(
        f'  {{\n    key: "{k}"\n    value: {{ string_value: "{v}" }}\n  }}' for k, v in params.items()
    )
    return (
        'backend: "fil"\nmax_batch_size: 32768\n'
        f'input [\n {{\n    name: "input__0"\n    data_type: TYPE_FP32\n    dims: [ {features} ]\n  }}\n]\n'
        f'output [\n {{\n    name: "output__0"\n    data_type: TYPE_FP32\n    dims: [ {out_dims} ]\n  }}\n]\n'
        f"instance_group [{{ kind: KIND_AUTO }}]\nparameters [\n{listed}\n]\n\ndynamic_batching {{}}\n"
    )


def add_model(root: Path, name: str, config: str, save: Callable[[Path], None], filename: str) -> Path:
    d = root / name
    (d / "1").mkdir(parents=True)
    (d / "config.pbtxt").write_text(config)
    save(d / "1" / filename)
    return d


# --- the models, trained once each on the same synthetic data ------------------------------------------


@cache
def xgb_binary() -> Any:
    return xgb.XGBClassifier(**SMALL, n_jobs=1).fit(TRAIN, Y_BINARY[:300])


@cache
def xgb_multi() -> Any:
    return xgb.XGBClassifier(**SMALL, n_jobs=1).fit(TRAIN, Y_MULTI[:300])


@cache
def xgb_regressor() -> Any:
    return xgb.XGBRegressor(**SMALL, n_jobs=1).fit(TRAIN, Y_REG[:300])


@cache
def xgb_softmax() -> tuple[Any, Any]:
    """The same trees under multi:softmax (predicts class ids) and multi:softprob (probabilities)."""
    params = {"num_class": 3, "max_depth": 3, "nthread": 1}
    data = xgb.DMatrix(TRAIN, Y_MULTI[:300])
    return tuple(xgb.train({**params, "objective": o}, data, 8) for o in ("multi:softmax", "multi:softprob"))


@cache
def lgb_model(kind: str) -> Any:
    cls = lgb.LGBMRegressor if kind == "regression" else lgb.LGBMClassifier
    y = {"binary": Y_BINARY, "multi": Y_MULTI, "regression": Y_REG}[kind][:300]
    return cls(n_estimators=12, num_leaves=7, min_child_samples=5, n_jobs=1, verbose=-1).fit(TRAIN, y)


@cache
def forest(kind: str) -> Any:
    cls = ensemble.RandomForestRegressor if kind == "regression" else ensemble.RandomForestClassifier
    y = {"binary": Y_BINARY, "multi": Y_MULTI, "regression": Y_REG}[kind][:300]
    return cls(n_estimators=8, max_depth=6, random_state=0, n_jobs=1).fit(TRAIN, y)


def xgb_save(model: Any) -> Callable[[Path], None]:
    booster = model if isinstance(model, xgb.Booster) else model.get_booster()

    def save(path: Path) -> None:
        with warnings.catch_warnings():  # "xgboost.model": it says it writes UBJSON for that name
            warnings.simplefilter("ignore", UserWarning)
            booster.save_model(str(path))

    return save


def lgb_save(kind: str) -> Callable[[Path], None]:
    return lambda path: lgb_model(kind).booster_.save_model(str(path))


def checkpoint(kind: str) -> Callable[[Path], None]:
    # How FIL's docs deploy a scikit-learn forest: converted to a Treelite checkpoint.
    return lambda path: treelite.sklearn.import_model(forest(kind)).serialize(str(path))


@dataclass
class Case:
    model_type: str
    filename: str
    save: Callable[[Path], None]
    out_dims: int
    classifier: bool
    expected: Callable[[np.ndarray], np.ndarray]  # the library's own answer for the held-out rows
    params: dict[str, str]


def case(model_type, filename, save, out_dims, classifier, expected, **params) -> Case:
    return Case(model_type, filename, save, out_dims, classifier, expected, params)


PROBA = {"predict_proba": "true"}
CASES: dict[str, Callable[[], Case]] = {
    "xgb-binary-json-class": lambda: case(
        "xgboost_json", "xgboost.json", xgb_save(xgb_binary()), 1, True, xgb_binary().predict
    ),
    "xgb-binary-json-proba2": lambda: case(
        "xgboost_json", "xgboost.json", xgb_save(xgb_binary()), 2, True, xgb_binary().predict_proba,
        **PROBA,
    ),
    # FIL's binary models count as one class: dims [1] is P(class 1).
    "xgb-binary-json-proba1": lambda: case(
        "xgboost_json", "xgboost.json", xgb_save(xgb_binary()), 1, True,
        lambda x: xgb_binary().predict_proba(x)[:, 1], **PROBA,
    ),
    "xgb-binary-threshold": lambda: case(
        "xgboost_ubj", "xgboost.ubj", xgb_save(xgb_binary()), 1, True,
        lambda x: xgb_binary().predict_proba(x)[:, 1] > np.float32(0.3), threshold="0.3",
    ),
    "xgb-multi-ubj-class": lambda: case(
        "xgboost_ubj", "xgboost.ubj", xgb_save(xgb_multi()), 1, True, xgb_multi().predict
    ),
    "xgb-multi-ubj-proba": lambda: case(
        "xgboost_ubj", "xgboost.ubj", xgb_save(xgb_multi()), 3, True, xgb_multi().predict_proba, **PROBA
    ),
    "xgb-softmax-class": lambda: case(
        "xgboost_json", "xgboost.json", xgb_save(xgb_softmax()[0]), 1, True,
        lambda x: xgb_softmax()[0].predict(xgb.DMatrix(x)),
    ),
    "xgb-softmax-proba": lambda: case(
        "xgboost_json", "xgboost.json", xgb_save(xgb_softmax()[0]), 3, True,
        lambda x: xgb_softmax()[1].predict(xgb.DMatrix(x)), **PROBA,
    ),
    # model_type "xgboost" names the legacy binary file; XGBoost >= 2.1 writes UBJSON under that name.
    "xgb-regression-xgboost-model": lambda: case(
        "xgboost", "xgboost.model", xgb_save(xgb_regressor()), 1, False, xgb_regressor().predict
    ),
    "xgb-default-model-filename": lambda: case(
        "xgboost_ubj", "regressor.ubj", xgb_save(xgb_regressor()), 1, False, xgb_regressor().predict
    ),
    "lgb-binary-class": lambda: case(
        "lightgbm", "model.txt", lgb_save("binary"), 1, True, lgb_model("binary").predict
    ),
    "lgb-binary-proba": lambda: case(
        "lightgbm", "model.txt", lgb_save("binary"), 2, True, lgb_model("binary").predict_proba, **PROBA
    ),
    "lgb-multi-class": lambda: case(
        "lightgbm", "model.txt", lgb_save("multi"), 1, True, lgb_model("multi").predict
    ),
    "lgb-multi-proba": lambda: case(
        "lightgbm", "model.txt", lgb_save("multi"), 3, True, lgb_model("multi").predict_proba, **PROBA
    ),
    "lgb-regression": lambda: case(
        "lightgbm", "model.txt", lgb_save("regression"), 1, False, lgb_model("regression").predict
    ),
    "sklearn-rf-binary-class": lambda: case(
        "treelite_checkpoint", "checkpoint.tl", checkpoint("binary"), 1, True, forest("binary").predict
    ),
    "sklearn-rf-multi-proba": lambda: case(
        "treelite_checkpoint", "checkpoint.tl", checkpoint("multi"), 3, True,
        forest("multi").predict_proba, **PROBA,
    ),
    "sklearn-rf-multi-class": lambda: case(
        "treelite_checkpoint", "checkpoint.tl", checkpoint("multi"), 1, True, forest("multi").predict
    ),
    "sklearn-rf-regression": lambda: case(
        "treelite_checkpoint", "checkpoint.tl", checkpoint("regression"), 1, False,
        forest("regression").predict,
    ),
}  # fmt: skip


def run_merged(instance: Any, x: np.ndarray) -> np.ndarray:
    """Several requests of different sizes executed as one batch; their outputs joined again."""
    cuts = [0, 1, 4, 11, 40, len(x)]
    reqs = [InferRequest({"input__0": x[a:b]}) for a, b in zip(cuts, cuts[1:], strict=False)]
    outs = instance.execute(reqs)
    assert [len(o["output__0"]) for o in outs] == [b - a for a, b in zip(cuts, cuts[1:], strict=False)]
    return np.concatenate([o["output__0"] for o in outs])


def check(ours: np.ndarray, expected: np.ndarray, classes: bool) -> None:
    expected = np.asarray(expected).reshape(len(ours), -1)
    assert ours.dtype == np.float32 and ours.shape == expected.shape
    if classes:
        np.testing.assert_array_equal(ours, expected.astype(np.float32))
    else:
        np.testing.assert_allclose(ours, expected, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("name", list(CASES))
def test_predictions_match_the_library(tmp_path: Path, name: str) -> None:
    c = CASES[name]()
    config = fil_config(FEATURES, c.out_dims, c.model_type, c.classifier, **c.params)
    if c.filename != MODEL_FILES[c.model_type]:
        config += f'default_model_filename: "{c.filename}"\n'
    d = add_model(tmp_path, "m", config, c.save, c.filename)
    instance = create_instances(load_config(d), d / "1")[0]
    classes = c.classifier and "predict_proba" not in c.params
    merged = run_merged(instance, TEST)
    check(merged, c.expected(TEST), classes)
    # One request of every row: the same answers, however the rows were batched.
    np.testing.assert_array_equal(
        instance.execute([InferRequest({"input__0": TEST})])[0]["output__0"], merged
    )


def test_classes_are_the_argmax_and_threshold_of_the_probabilities(tmp_path: Path) -> None:
    """FIL's class output is derived from the same probabilities: argmax, or p > threshold."""
    for name, dims, model, params in (
        ("multi", 3, xgb_multi(), {}),
        ("binary", 1, xgb_binary(), {"threshold": "0.7"}),
    ):
        classed = add_model(
            tmp_path, name, fil_config(FEATURES, 1, "xgboost_json", True, **params), xgb_save(model),
            "xgboost.json",
        )  # fmt: skip
        proba = add_model(
            tmp_path, f"{name}_p", fil_config(FEATURES, dims, "xgboost_json", True, **PROBA), xgb_save(model),
            "xgboost.json",
        )  # fmt: skip
        c = run_merged(create_instances(load_config(classed), classed / "1")[0], TEST)
        p = run_merged(create_instances(load_config(proba), proba / "1")[0], TEST)
        want = p.argmax(axis=1) if dims > 1 else p[:, 0] > np.float32(0.7)
        np.testing.assert_array_equal(c[:, 0], want.astype(np.float32))


def half_a_lightgbm_model(tmp_path: Path) -> bytes:
    lgb_save("binary")(tmp_path / "whole.txt")
    text = (tmp_path / "whole.txt").read_bytes()
    return text[: len(text) // 2]


def bad_models(tmp_path: Path) -> dict[str, tuple[str, bytes | None, str]]:
    """name: (model_type, the file's content (None: no file), what the load error says)."""
    return {
        "garbage-json": ("xgboost_json", b'{"learner": ', "cannot load"),
        "garbage-ubj": ("xgboost_ubj", b"\x00\x01binary junk", "cannot load"),
        "garbage-legacy": ("xgboost", b"binf" + bytes(40), "cannot load"),
        "empty": ("xgboost_ubj", b"", "the file is empty"),
        # LightGBM's reader aborts the process on this one: the probe must catch it.
        "truncated-lightgbm": ("lightgbm", half_a_lightgbm_model(tmp_path), "cannot load"),
        "garbage-checkpoint": ("treelite_checkpoint", b"not a checkpoint" * 4, "cannot load"),
        "unknown-type": ("catboost", b"x", "model_type 'catboost' is not one of"),
        "missing-file": ("lightgbm", None, "not found"),
    }


def test_bad_models_fail_their_load_with_one_line(tmp_path: Path) -> None:
    (tmp_path / "scratch").mkdir()
    bad = bad_models(tmp_path / "scratch")
    for name, (model_type, content, _) in bad.items():

        def write(path: Path, content: bytes | None = content) -> None:
            if content is not None:
                path.write_bytes(content)

        filename = MODEL_FILES.get(model_type, "model.bin")
        add_model(tmp_path / "repo", name, fil_config(FEATURES, 1, model_type, True), write, filename)
    # The config's tensors are checked against the model.
    repo, good = tmp_path / "repo", xgb_save(xgb_multi())
    add_model(repo, "features", fil_config(5, 1, "xgboost_json", True), good, "xgboost.json")
    add_model(repo, "classes", fil_config(FEATURES, 2, "xgboost_json", True, **PROBA), good, "xgboost.json")
    add_model(repo, "ok", fil_config(FEATURES, 3, "xgboost_json", True, **PROBA), good, "xgboost.json")

    async def main() -> dict[str, dict]:
        models = ModelRepository(repo)
        await models.start()  # a model that fails to load leaves the others (and the process) running
        index = {m["name"]: m for m in models.index()}
        await models.close()
        return index

    index = asyncio.run(main())
    assert index["ok"]["state"] == "READY"
    expected = {name: said for name, (*_, said) in bad.items()}
    expected["features"] = "input__0 dims [5], but the model has 6 features"
    expected["classes"] = "output__0 dims [2], but this model gives the probabilities of 3 classes: dims [3]"
    for name, said in expected.items():
        reason = index[name]["reason"]
        assert index[name]["state"] == "UNAVAILABLE" and said in reason, (name, reason)
        assert "\n" not in reason and "Traceback" not in reason and "Stack trace" not in reason, reason


def test_bad_parameters_are_load_errors(tmp_path: Path) -> None:
    save = xgb_save(xgb_binary())
    for params, said in (
        ({"predict_proba": "yes"}, "parameter predict_proba is 'yes'"),
        ({"threshold": "high"}, "parameter threshold is 'high'"),
    ):
        d = add_model(
            tmp_path, "m", fil_config(FEATURES, 1, "xgboost_json", True, **params), save, "xgboost.json"
        )
        with pytest.raises(ModelError, match=said):
            create_instances(load_config(d), d / "1")
        shutil.rmtree(d)


# --- one real server -------------------------------------------------------------------------------------


def test_served_over_http_and_grpc_with_dynamic_batching(tmp_path: Path) -> None:
    from server_fixture import free_port, running_server

    http = pytest.importorskip("tritonclient.http", reason="tritonclient[http] is a dev dependency")
    grpc = pytest.importorskip("tritonclient.grpc", reason="tritonclient[grpc] is a dependency")
    binary, multi = xgb_binary(), lgb_model("multi")
    config = fil_config(FEATURES, 2, "xgboost_ubj", True, **PROBA).replace(
        "dynamic_batching {}", "dynamic_batching { max_queue_delay_microseconds: 200000 }"
    )
    add_model(tmp_path, "fraud", config, xgb_save(binary), "xgboost.ubj")
    add_model(tmp_path, "species", fil_config(FEATURES, 1, "lightgbm", True), lgb_save("multi"), "model.txt")
    add_model(
        tmp_path,
        "broken",
        fil_config(FEATURES, 1, "lightgbm", True),
        lambda p: p.write_text("?"),
        "model.txt",
    )
    grpc_port = free_port()
    with running_server("--model-repository", str(tmp_path), "--grpc-port", str(grpc_port)) as server:
        client = http.InferenceServerClient(server.base_url.removeprefix("http://"), concurrency=16)

        def http_input(rows: np.ndarray) -> Any:
            inp = http.InferInput("input__0", list(rows.shape), "FP32")
            inp.set_data_from_numpy(rows)
            return inp

        # 20 concurrent requests of 5 rows: the dynamic batcher merges them into fewer executions.
        before = client.get_inference_statistics("fraud")["model_stats"][0]["execution_count"]
        chunks = np.split(TEST, 20)
        pending = [client.async_infer("fraud", [http_input(c)]) for c in chunks]
        got = np.concatenate([p.get_result().as_numpy("output__0") for p in pending])
        stats = client.get_inference_statistics("fraud")["model_stats"][0]
        check(got, binary.predict_proba(TEST), classes=False)
        assert stats["inference_count"] == len(TEST) and stats["execution_count"] - before < len(chunks)

        g = grpc.InferenceServerClient(f"127.0.0.1:{grpc_port}")
        inp = grpc.InferInput("input__0", list(TEST.shape), "FP32")
        inp.set_data_from_numpy(TEST)
        check(g.infer("species", [inp]).as_numpy("output__0"), multi.predict(TEST), classes=True)
        assert g.get_model_config("species").config.backend == "fil"

        index = {m["name"]: m for m in client.get_model_repository_index()}
        assert index["broken"]["state"] == "UNAVAILABLE"
        assert "cannot load" in index["broken"]["reason"] and "as lightgbm" in index["broken"]["reason"]
        assert client.is_server_live()  # the broken model did not take the server down
