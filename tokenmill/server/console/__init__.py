"""The web console `tokenmill serve` serves at /ui: live charts, the fleet, the KServe model repository,
a chat playground and a viewer for `tokenmill bench` results (docs/guides/console.md).

The page is static (static/, shipped built: no node at install) and reads the server's own APIs; the
one route added for it, GET /v1/console/live, is a JSON snapshot of the figures /metrics holds in a
form awkward for a browser (per-request latency percentiles, the fleet's rows, the planner's
decisions). It sits behind the API key like every /v1 route, and is computed only when asked.
"""

from __future__ import annotations

import math
import os
import time
from pathlib import Path
from typing import Any

from fastapi import FastAPI
from fastapi.responses import JSONResponse

import tokenmill
from tokenmill.server.console.assets import ConsoleAssets
from tokenmill.server.console.fleet import fleet_view, worker_name
from tokenmill.server.console.live import (
    DEFAULT_WINDOW_S,
    cache_counters,
    engine_counters,
    engine_state,
    latency_window,
    load_now,
    request_counters,
)

LIVE_PATH = "/v1/console/live"


def display_name(model_name: str) -> str:
    """The served model's name as the console shows it: a name given as a file or folder (`--model
    /models/x.gguf` without --served-model-name) shows as its last part, never as a path."""
    if model_name.startswith(("/", "~", ".")) or (os.sep in model_name and Path(model_name).exists()):
        return Path(model_name).name
    return model_name  # a catalog name, or a hub id (org/name) that is not a local folder


def install_console(app: FastAPI, state: Any) -> None:  # noqa: ANN401 - the server's ServerState
    """The page and its files at /ui (open: they hold no data), and its live endpoint (behind the key)."""
    app.add_middleware(ConsoleAssets)  # outermost: in front of the API key's middleware
    config, llm, metrics = state.config, state.llm, state.metrics
    repository = bool(config.model_repository)  # (the KServe v2 routes are there with it)
    model = display_name(config.model_name)

    @app.get(LIVE_PATH, include_in_schema=False)
    async def console_live(window: float = DEFAULT_WINDOW_S) -> JSONResponse:
        # Metrics keeps the records end-to-end times come from for its window (60 s): no longer here.
        window_s = min(max(window, 1.0), metrics.window_s) if math.isfinite(window) else DEFAULT_WINDOW_S
        client = llm.client
        stats = client.stats
        body = {
            "time": time.time(),
            "server": {
                "model": model,
                "version": tokenmill.__version__,
                "max_model_len": llm.max_model_len if client.info else None,
                "block_size": client.info.get("block_size"),
                "repository": repository,
                "model_control_mode": config.model_control_mode if repository else None,
                "api_key_required": config.requires_key,
            },
            "engine": engine_state(client, state.draining),
            "counters": {**request_counters(metrics), **cache_counters(stats)},
            # The same engine counters per engine (and per life of it): what the page's rates come from.
            "engines": engine_counters(client, worker_name),
            "load": load_now(stats, state.admission.sequences),
            "latency": latency_window(metrics, window_s),
            # Over the metrics window (60 s), as /metrics' tokenmill:queue_to_compute_ratio.
            "queue_to_compute": metrics.queue_to_compute_ratio(),
            "fleet": fleet_view(client, state.planner),
        }
        return JSONResponse(body, headers={"Cache-Control": "no-store"})
