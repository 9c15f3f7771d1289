"""Fit the efficiency factors to measurements, so that sizing starts from the user's own numbers.

Each measured load level (a `tokenmill bench` summary: its concurrency, mean ISL and OSL, mean TTFT,
mean ITL and request throughput) is predicted by the lockstep model; the factors minimise the
squared log-ratios of predicted to measured TTFT, ITL and requests/s over all levels (scipy's
least_squares, within physical bounds). Open-loop levels enter with the concurrency Little's law
gives them (throughput x mean E2E).

Some factors trade off against each other when the data do not separate them (the weight bandwidth
and the fixed per-layer overhead both cost the same at every batch size for one model): the fit then
still predicts well, and the report says which factors moved together.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np

from tokenmill.extras import require
from tokenmill.sizing.hardware import Factors
from tokenmill.sizing.roofline import Deployment, predict

# Fitted parameters and their bounds; the others keep the starting factors' values.
FIT = {
    "mfu": (1e-3, 1.0),
    "mbu_weights": (1e-3, 1.0),
    "mbu_kv": (1e-3, 1.0),
    "overhead_per_layer_s": (0.0, 0.05),
    "client_s": (0.0, 2.0),
}


@dataclass(frozen=True)
class Measurement:
    concurrency: float
    isl: float
    osl: float
    ttft_s: float
    itl_s: float
    rps: float
    label: str = ""


def measurements_from_summary(path: Path) -> list[Measurement]:
    """Every level of a `tokenmill bench` summary.json (single level or sweep)."""
    try:
        d = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise ValueError(f"{path}: cannot read a bench summary ({e})") from None
    runs = d.get("runs", [d])
    out = []
    for r in runs:
        try:
            ttft, itl, e2e = r["ttft_ms"]["mean"], r["itl_ms"]["mean"], r["e2e_ms"]["mean"]
            rps = r["request_throughput"]
            conc = r.get("concurrency") or (r.get("config") or {}).get("load", {}).get("concurrency")
            if not conc:
                conc = rps * e2e / 1e3  # Little's law for open-loop levels
            out.append(
                Measurement(
                    conc,
                    r["isl"]["mean"],
                    r["osl"]["mean"],
                    ttft / 1e3,
                    itl / 1e3,
                    rps,
                    r.get("label", path.stem),
                )
            )
        except (KeyError, TypeError):
            raise ValueError(f"{path}: a level lacks streaming metrics (ttft_ms, itl_ms, isl, osl)") from None
    return out


def _with(f: Factors, x: np.ndarray) -> Factors:
    return replace(f, **{k: float(v) for k, v in zip(FIT, x, strict=True)})


def residuals(d: Deployment, ms: list[Measurement]) -> np.ndarray:
    res = []
    for m in ms:
        p = predict(d, max(1, round(m.concurrency)), round(m.isl), round(m.osl))
        res += [math.log(p.ttft_s / m.ttft_s), math.log(p.itl_s / m.itl_s), math.log(p.rps / m.rps)]
    return np.asarray(res)


@dataclass
class Fit:
    factors: Factors
    errors: dict[str, dict[str, float]]  # metric -> median and max absolute relative error
    per_level: list[dict[str, Any]]


def fit(deployments: list[tuple[Deployment, list[Measurement]]], start: Factors) -> Fit:
    """Fit one factor set to measurements taken on one or more deployments (same GPU and precision)."""
    x0 = np.array([getattr(start, k) for k in FIT])
    lo, hi = np.array([b[0] for b in FIT.values()]), np.array([b[1] for b in FIT.values()])
    x0 = np.clip(x0, lo + 1e-9, hi - 1e-9)

    def fun(x: np.ndarray) -> np.ndarray:
        f = _with(start, x)
        return np.concatenate([residuals(replace(d, factors=f), ms) for d, ms in deployments])

    require("bench", "the calibration fit (tokenmill size calibrate)")
    from scipy.optimize import least_squares  # here: loading saved factors imports without the extra

    sol = least_squares(fun, x0, bounds=(lo, hi), x_scale="jac")
    factors = replace(_with(start, sol.x), source="calibrated from measurements")
    per_level, errs = [], {"ttft": [], "itl": [], "rps": []}
    for d, ms in deployments:
        dd = replace(d, factors=factors)
        for m in ms:
            p = predict(dd, max(1, round(m.concurrency)), round(m.isl), round(m.osl))
            row = {"label": m.label, "concurrency": m.concurrency}
            for name, pred, meas in (
                ("ttft", p.ttft_s, m.ttft_s),
                ("itl", p.itl_s, m.itl_s),
                ("rps", p.rps, m.rps),
            ):
                row[f"{name}_measured"], row[f"{name}_predicted"] = meas, pred
                errs[name].append(abs(pred / meas - 1))
            per_level.append(row)
    summary = {k: {"median": float(np.median(v)), "max": float(np.max(v))} for k, v in errs.items() if v}
    return Fit(factors, summary, per_level)


def save_factors(f: Factors, path: Path) -> None:
    path.write_text(json.dumps(f.to_dict(), indent=2))


def load_factors(path: Path) -> Factors:
    try:
        d = json.loads(path.read_text())
        return Factors(**{k: v for k, v in d.items() if k in Factors.__dataclass_fields__})
    except (OSError, json.JSONDecodeError, TypeError) as e:
        raise ValueError(f"{path}: not a factors file ({e})") from None
