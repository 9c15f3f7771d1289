"""Triton's FIL backend (`backend: "fil"`): XGBoost, LightGBM and Treelite-checkpoint (scikit-learn) forests.

A repository written for Triton's FIL backend loads unchanged: the same `parameters`, file names, tensors
(`input__0` FP32 [n_features] in, `output__0` FP32 out) and output semantics:

- classifier (`output_class: "true"`): the class id as a float, dims [1]; a binary model's probability of
  class 1 is compared with `threshold` (default 0.5, strictly greater is class 1), a multi-class model
  gives the arg-max of its probabilities;
- `predict_proba: "true"`: the probabilities instead, dims [n_classes]; a binary model counts as one
  class (dims [1]: P(class 1)), or, declared with dims [2], gives [1 - p, p] as FIL then does;
- regressor (`output_class: "false"`): the model's prediction, dims [1] (or [n_targets]).

Which engine runs each format, and why: the libraries' own predictors for their own files (XGBoost's
`Booster.inplace_predict`, LightGBM's `Booster.predict`). Their outputs are what the user's training code
predicts, to the bit (Treelite's GTIL, FIL's CPU path, sums XGBoost's trees in float32 in another order:
an ulp off). Speed, measured on a 100-tree depth-6 model on one thread: LightGBM's predictor is ahead of
GTIL at batch 1 and 1024; XGBoost's gives about 4x GTIL's rows/s at batch 1024 but has a fixed cost of
~150 us a call, about 3x GTIL's time at batch 1. Agreement, and throughput at the batches a dynamic
batcher forms, decided it. A checkpoint (how scikit-learn and cuML forests are deployed) is Treelite's own
format: GTIL runs it, as in FIL; so is XGBoost's legacy binary format, which XGBoost 3 no longer reads.
"""

from __future__ import annotations

import importlib.util
import json
import logging
import os
import re
import signal
import subprocess
import sys
from abc import ABC, abstractmethod
from pathlib import Path
from typing import Any

import numpy as np

from tokenmill.extras import require
from tokenmill.triton.backends import InferRequest, ModelError, Outputs, _BatchingInstance, _model_file
from tokenmill.triton.config import TritonModelConfig

log = logging.getLogger(__name__)

MODEL_FILES = {
    "xgboost": "xgboost.model",  # XGBoost's legacy binary format
    "xgboost_json": "xgboost.json",
    "xgboost_ubj": "xgboost.ubj",
    "lightgbm": "model.txt",
    "treelite_checkpoint": "checkpoint.tl",
}
INPUT, OUTPUT = "input__0", "output__0"

# FIL's performance knobs. Each picks how FIL lays the trees out or schedules them on a GPU (or which
# of its own CPU kernels runs) and never changes a prediction; the libraries here choose their own CPU
# layout, so there is nothing for them to tune. Accepted so that a FIL repository loads unchanged.
# (layout and chunk_size are the names FIL 25.09 gave algo and threads_per_tree.)
IGNORED = frozenset(
    {
        "threads_per_tree",
        "storage_type",
        "algo",
        "blocks_per_sm",
        "transfer_threshold",
        "use_experimental_optimizations",
        "layout",
        "chunk_size",
        # FIL passes it to Treelite's JSON reader, which otherwise rejects fields it does not know;
        # XGBoost's own reader, used here, skips them anyway.
        "xgboost_allow_unknown_field",
    }
)
KNOWN = IGNORED | {"model_type", "output_class", "is_classifier", "predict_proba", "threshold", "cpu_nthread"}


def _flag(cfg: TritonModelConfig, key: str, default: bool) -> bool:
    value = cfg.parameters.get(key, "").strip().lower()
    if not value:
        return default
    if value not in ("true", "false"):
        raise ModelError(f'{cfg.name}: parameter {key} is {value!r}: use "true" or "false"')
    return value == "true"


def _number(cfg: TritonModelConfig, key: str, default: float) -> float:
    value = cfg.parameters.get(key, "").strip()
    try:
        return float(value) if value else default
    except ValueError:
        raise ModelError(f"{cfg.name}: parameter {key} is {value!r}: not a number") from None


def _first_line(text: str) -> str:
    """A library's error as one line: XGBoost's carry a C++ stack trace after the first, and the native
    libraries start theirs with a time and a source location ("[20:04:44] src/x.cc:409: ")."""
    lines = [s.strip() for s in text.splitlines() if s.strip()]
    line = lines[0] if lines else "unknown error"
    return re.sub(r"^\[\d\d:\d\d:\d\d\] \S+:\d+: ", "", line)


# The native readers of these formats do not all fail cleanly: LightGBM aborts or segfaults on a
# truncated model.txt, XGBoost aborts on an empty file. Such a crash would take the whole server down
# (the LLM with it), so a file is first read by the same library function in a child process that has
# only ctypes and the library (no numpy, no package imports: a few tens of ms), and only a file that
# it read without error is loaded here.
_PROBE = r"""
import ctypes, sys
lib_path, kind, path = sys.argv[1:4]
lib = ctypes.CDLL(lib_path)
handle = ctypes.c_void_p()
if kind == "xgboost":
    data = open(path, "rb").read()
    rc = lib.XGBoosterCreate(None, ctypes.c_uint64(0), ctypes.byref(handle))
    rc = rc or lib.XGBoosterLoadModelFromBuffer(handle, data, ctypes.c_uint64(len(data)))
    error = lib.XGBGetLastError
elif kind == "xgboost_legacy":
    rc = lib.TreeliteLoadXGBoostModelLegacyBinary(path.encode(), b"{}", ctypes.byref(handle))
    error = lib.TreeliteGetLastError
elif kind == "lightgbm":
    iterations = ctypes.c_int()
    rc = lib.LGBM_BoosterCreateFromModelfile(path.encode(), ctypes.byref(iterations), ctypes.byref(handle))
    error = lib.LGBM_GetLastError
else:
    rc = lib.TreeliteDeserializeModelFromFile(path.encode(), ctypes.byref(handle))
    error = lib.TreeliteGetLastError
if rc != 0:
    error.restype = ctypes.c_char_p
    sys.stdout.write("\n--- probe error ---\n" + error().decode("utf-8", "replace"))
    sys.exit(1)
"""
PROBE_TIMEOUT_S = 600  # reading a forest of millions of nodes takes seconds; a hang never ends
_LIBRARIES = {  # kind -> (package, its shared library, inside the package)
    "xgboost": ("xgboost", "lib/libxgboost.so"),
    "lightgbm": ("lightgbm", "lib/lib_lightgbm.so"),
    "treelite": ("treelite", "lib/libtreelite.so"),
    "xgboost_legacy": ("treelite", "lib/libtreelite.so"),
}


def _probe(kind: str, path: Path) -> str | None:
    """Why `path` cannot be read by `kind`'s library, or None when it can (or when the library's shared
    object is not where this probe looks: then the load itself is the check)."""
    package, rel = _LIBRARIES[kind]
    spec = importlib.util.find_spec(package)  # finds the package without importing it
    locations = list(spec.submodule_search_locations or []) if spec else []
    lib = next((Path(d) / rel for d in locations if (Path(d) / rel).is_file()), None)
    if lib is None:
        return None
    try:
        r = subprocess.run(
            [sys.executable, "-I", "-S", "-c", _PROBE, str(lib), kind, str(path)],
            capture_output=True, text=True, errors="replace", timeout=PROBE_TIMEOUT_S, check=False,
        )  # fmt: skip
    except subprocess.TimeoutExpired:
        return f"{package} did not finish reading it in {PROBE_TIMEOUT_S} s"
    if r.returncode == 0:
        return None
    if r.returncode < 0:  # killed by a signal: the reader crashed
        name = signal.Signals(-r.returncode).name
        return f"{package} crashed reading it ({name}): the file is damaged or not in this format"
    marker = "--- probe error ---\n"
    return _first_line(r.stdout.split(marker, 1)[1] if marker in r.stdout else r.stderr or r.stdout)


class _Forest(ABC):
    """A loaded model: its shape, and its scores (probabilities for a classifier) for a batch of rows."""

    kind: str  # the reader, as _probe names it
    n_features: int
    n_outputs: int  # score columns: 1 for a binary classifier or a regressor, else classes (or targets)

    @abstractmethod
    def scores(self, x: np.ndarray) -> np.ndarray:
        """(rows, n_outputs) float32 for (rows, n_features) float32."""


class _XGBoost(_Forest):
    kind = "xgboost"

    def __init__(self, path: Path, threads: int) -> None:
        import xgboost

        self.booster = xgboost.Booster()
        # From bytes, the format (JSON, UBJSON, legacy binary) is told by the content, whatever the file
        # is called (default_model_filename); from a path it goes by the extension, guessing for others.
        self.booster.load_model(bytearray(path.read_bytes()))
        self.booster.set_param({"nthread": threads})
        learner = json.loads(self.booster.save_config())["learner"]
        self.objective = learner["objective"]["name"]
        params = learner["learner_model_param"]
        self.n_features = self.booster.num_features()
        classes, targets = int(params.get("num_class", "0")), int(params.get("num_target", "1"))
        self.n_outputs = classes if self.objective.startswith("multi:") else max(1, targets)

    def scores(self, x: np.ndarray) -> np.ndarray:
        if self.objective == "multi:softmax":
            # Its prediction is the class id; FIL gives this objective's probabilities for predict_proba,
            # which are the softmax of the margins (what multi:softprob predicts). Computed in float64
            # so that rounding to float32 happens once.
            margin = self.booster.inplace_predict(x, predict_type="margin").astype(np.float64)
            e = np.exp(margin - margin.max(axis=1, keepdims=True))
            return (e / e.sum(axis=1, keepdims=True)).astype(np.float32)
        return np.asarray(self.booster.inplace_predict(x), dtype=np.float32).reshape(len(x), -1)


class _LightGBM(_Forest):
    kind = "lightgbm"

    def __init__(self, path: Path, threads: int) -> None:
        import lightgbm

        self.booster = lightgbm.Booster(model_file=str(path))
        self.threads = threads
        self.n_features = self.booster.num_feature()
        self.n_outputs = self.booster.num_model_per_iteration()

    def scores(self, x: np.ndarray) -> np.ndarray:
        out = self.booster.predict(x, num_threads=self.threads)
        return np.asarray(out, dtype=np.float32).reshape(len(x), -1)


class _Treelite(_Forest):
    """A Treelite checkpoint, run by GTIL."""

    kind = "treelite"

    def __init__(self, path: Path, threads: int) -> None:
        self.model = self._read(path)
        self.threads = threads
        header = self.model.get_header_accessor()
        targets = int(header.get_field("num_target")[0])
        if targets != 1:
            raise ModelError(f"{path}: a model with {targets} targets (FIL serves single-target models)")
        self.n_features = self.model.num_feature
        self.n_outputs = int(header.get_field("num_class")[0])
        # A scikit-learn forest has float64 thresholds: its rows are compared in float64 (float32
        # widens exactly), as scikit-learn compares its own float32-cast rows with them.
        self.dtype = np.dtype(self.model.input_type)

    @staticmethod
    def _read(path: Path) -> Any:
        import treelite

        return treelite.Model.deserialize(str(path))

    def scores(self, x: np.ndarray) -> np.ndarray:
        import treelite.gtil

        out = treelite.gtil.predict(self.model, x.astype(self.dtype, copy=False), nthread=self.threads)
        return np.asarray(out[:, 0, :], dtype=np.float32)  # (rows, targets = 1, classes)


class _XGBoostLegacy(_Treelite):
    """XGBoost's legacy binary format, which XGBoost itself no longer reads (3.0 dropped it): Treelite
    reads it, and GTIL runs it, as FIL does for every format."""

    kind = "xgboost_legacy"

    @staticmethod
    def _read(path: Path) -> Any:
        import treelite.frontend

        return treelite.frontend.load_xgboost_model_legacy_binary(path)


def _reader(model_type: str, path: Path) -> type[_Forest]:
    if model_type == "lightgbm":
        return _LightGBM
    if model_type == "treelite_checkpoint":
        return _Treelite
    # XGBoost since 2.1 writes UBJSON to a file named xgboost.model (a name without .json or .ubj):
    # such a file starts as JSON and UBJSON do, and XGBoost reads it; a legacy binary file does not.
    with path.open("rb") as f:
        json_like = f.read(1) == b"{"
    return _XGBoost if json_like or model_type != "xgboost" else _XGBoostLegacy


class FilInstance(_BatchingInstance):
    """One loaded copy of a tree model; a batch of requests is one call of its library."""

    def __init__(self, cfg: TritonModelConfig, version_dir: Path, index: int) -> None:
        super().__init__(cfg)
        # A MissingExtra is an ImportError: the repository reports it as this model's load error.
        require("fil", f"{cfg.name}: the fil backend")
        if cfg.decoupled:  # FIL answers every request with one response
            raise ModelError(f"{cfg.name}: the fil backend does not support decoupled models")
        model_type = cfg.parameters.get("model_type", "xgboost")  # FIL's default
        if model_type not in MODEL_FILES:
            raise ModelError(f"{cfg.name}: model_type {model_type!r} is not one of {', '.join(MODEL_FILES)}")
        unknown = sorted(set(cfg.parameters) - KNOWN)
        if unknown and index == 0:  # Triton's FIL ignores parameters it does not know: so do we, saying so
            log.warning("%s: the fil backend ignores parameters %s", cfg.name, ", ".join(unknown))
        # output_class is FIL's name until 25.09, is_classifier after: either is read.
        self.classifier = _flag(cfg, "output_class", _flag(cfg, "is_classifier", False))
        self.proba = _flag(cfg, "predict_proba", False)
        self.threshold = _number(cfg, "threshold", 0.5)
        # FIL's cpu_nthread (<= 0: every core). Unset, one thread: instances are the unit of concurrency
        # here (instance_group count), as for the onnxruntime backend, and OpenMP threads that spin on
        # cores other instances or models hold were measured 3-10x slower on a busy 2-core machine.
        nthread = int(_number(cfg, "cpu_nthread", 1))
        threads = nthread if nthread > 0 else os.cpu_count() or 1
        path = _model_file(version_dir, cfg, MODEL_FILES[model_type])
        if path.stat().st_size == 0:
            raise ModelError(f"{cfg.name}: cannot load {path} as {model_type}: the file is empty")
        reader = _reader(model_type, path)
        # The instances load the same file: one probe answers for all.
        why = _probe(reader.kind, path) if index == 0 else None
        if why is None:
            try:
                self.forest = reader(path, threads)
            except ModelError:
                raise
            except Exception as e:  # each library raises its own types for a file it cannot read
                why = _first_line(str(e))
        if why is not None:
            raise ModelError(f"{cfg.name}: cannot load {path} as {model_type}: {why}")
        self.width = self._check_tensors()

    def _check_tensors(self) -> int:
        """The config's tensors against the model; returns output__0's width."""
        cfg, forest = self.cfg, self.forest
        where = f"{cfg.name} (fil)"
        inputs, outputs = {t.name: t for t in cfg.inputs}, {t.name: t for t in cfg.outputs}
        if set(inputs) != {INPUT}:
            raise ModelError(f"{where}: needs exactly one input, {INPUT!r} (the config has {sorted(inputs)})")
        if OUTPUT not in outputs:
            raise ModelError(f"{where}: needs an output {OUTPUT!r} (the config has {sorted(outputs)})")
        others = sorted(set(outputs) - {OUTPUT})
        if others:
            raise ModelError(f"{where}: outputs {others} are not supported (only {OUTPUT!r}; no SHAP values)")
        for t in (inputs[INPUT], outputs[OUTPUT]):
            if t.datatype != "FP32":
                raise ModelError(f"{where}: {t.name} is {t.datatype}; FIL's tensors are TYPE_FP32")
        features = inputs[INPUT].dims[-1] if inputs[INPUT].dims else None
        if features not in (forest.n_features, -1):
            raise ModelError(
                f"{where}: {INPUT} dims {inputs[INPUT].dims}, but the model has {forest.n_features} features"
            )
        k = forest.n_outputs
        if self.classifier and not self.proba:
            widths, what = [1], "a class id"
        elif self.classifier and k == 1:
            widths, what = [1, 2], "P(class 1) of a binary classifier, or [1 - p, p]"
        elif self.classifier:
            widths, what = [k], f"the probabilities of {k} classes"
        else:
            widths, what = [k], f"{k} regression value{'s' if k > 1 else ''}"
        out_dims = outputs[OUTPUT].dims
        width = out_dims[-1] if out_dims else None
        if width not in widths:
            want = " or ".join(f"[{w}]" for w in widths)
            raise ModelError(f"{where}: {OUTPUT} dims {out_dims}, but this model gives {what}: dims {want}")
        return int(width)  # type: ignore[arg-type]

    def execute(self, reqs: list[InferRequest]) -> list[Outputs | Exception]:
        if len(reqs) == 1:  # nothing to merge or split: ~10 us less at batch 1, a tree model's ~10-20%
            return [self.run(reqs[0].inputs, [OUTPUT])]
        return super().execute(reqs)

    def run(self, inputs: dict[str, np.ndarray], outputs: list[str]) -> Outputs:
        x = inputs[INPUT]
        nf = self.forest.n_features
        if x.shape[-1] != nf:  # only when the config leaves the width variable (-1)
            raise ModelError(f"{self.cfg.name}: {INPUT} rows have {x.shape[-1]} features, the model {nf}")
        rows = np.ascontiguousarray(x.reshape(-1, nf), dtype=np.float32)
        out = self._predict(rows) if len(rows) else np.zeros((0, self.width), np.float32)
        return {OUTPUT: out.reshape(*x.shape[:-1], self.width)}

    def _predict(self, rows: np.ndarray) -> np.ndarray:
        scores = self.forest.scores(rows)
        if self.classifier and not self.proba:
            # Binary: strictly above the threshold is class 1; else the first of equal maxima, as FIL.
            classes = scores[:, 0] > self.threshold if scores.shape[1] == 1 else scores.argmax(axis=1)
            return classes.astype(np.float32)[:, None]
        if self.classifier and self.width == 2 and scores.shape[1] == 1:
            return np.concatenate([1 - scores, scores], axis=1)
        return scores
