"""The optional parts of tokenmill and the packages each needs: `pip install tokenmill` serves the OpenAI
API; KServe v2 backends, bench plots and sizing, Ray and Kubernetes are extras (pyproject.toml).

A feature that needs an extra asks for it before it starts (before an engine loads, a benchmark runs),
so that a missing package is one line saying what to install, not a traceback from deep inside. The
optional packages themselves are imported lazily, inside the functions that use them: `import
tokenmill.server.app` and `tokenmill serve --model X` never touch them.
"""

from __future__ import annotations

import importlib.util

# extra -> the top-level modules it installs (what is imported, not the distributions' names).
EXTRAS: dict[str, tuple[str, ...]] = {
    "triton": ("onnxruntime", "tritonclient", "grpc"),  # grpc: tritonclient[grpc]'s grpcio
    "fil": ("xgboost", "lightgbm", "treelite", "sklearn"),  # xgboost: the xgboost-cpu distribution
    "bench": ("matplotlib", "scipy"),
    "ray": ("ray",),
    "k8s": ("kubernetes",),
    # A namespace package: its parts are looked up (and only "opentelemetry" itself imported to do so).
    "tracing": ("opentelemetry.sdk", "opentelemetry.exporter.otlp.proto.http"),
}


class MissingExtra(ImportError, ValueError):
    """A feature whose extra is not installed. An ImportError (a package is missing), and a ValueError
    (what was asked cannot run on this install): the commands already turn those into their one-line
    error, `serve` among them."""

    def __init__(self, extra: str, feature: str, module: str) -> None:
        install = f"pip install 'tokenmill[{extra}]'"
        message = f"{feature} needs the {extra} extra ({module} is not installed): {install}"
        super().__init__(message, name=module)
        self.extra = extra


def _installed(module: str) -> bool:
    try:
        # find_spec looks the module up without importing it (these are top-level names: no parent
        # package is imported either); None when it is absent or blocked (sys.modules[name] = None).
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):  # a half-removed package: as good as absent
        return False


def missing(extra: str, feature: str) -> MissingExtra | None:
    """The error to report if `extra` is not fully installed, else None. `feature` names what needs it
    as the user asked for it, e.g. "tokenmill bench" or "serve --launcher ray"."""
    for module in EXTRAS[extra]:
        if not _installed(module):
            return MissingExtra(extra, feature, module)
    return None


def require(extra: str, feature: str) -> None:
    """Raise MissingExtra unless `extra` is installed."""
    error = missing(extra, feature)
    if error is not None:
        raise error
