"""tokenmill's own C++ CPU kernels, compiled on first use with torch.utils.cpp_extension.

One build per instruction-set level (tokenmill/kernels/isa.py); the best level this CPU runs is used.
Compilation (kernels/build.py, in a child process that reports each step) takes about a minute per
level on 2 cores and is cached per level, Python and torch version
and source hash under the cache folder (a finished build is then imported by any checkout or virtualenv
that matches); a machine without a C++ compiler, or an x86 CPU without AVX2, falls back
to the plain-PyTorch implementations with a one-line warning.
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib.util
import logging
import os
import sys
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType

import torch

from tokenmill.kernels.build import BUILT, CSRC, UNITS, build, module_name
from tokenmill.kernels.isa import IsaLevel, best_level, get_level
from tokenmill.paths import default_cache_dir

try:
    import fcntl
except ImportError:  # not POSIX: PyTorch's own lock file alone
    fcntl = None  # type: ignore[assignment]

log = logging.getLogger(__name__)
_modules: dict[str, ModuleType] = {}
_failed: dict[str, str] = {}


def build_dir(level: IsaLevel) -> Path:
    # Keyed by a hash of every source and header and of the flags: torch's loader only notices
    # changes to the .cpp files it is given, and a stale build must never be picked up.
    # Python's version too: the library is built against its headers.
    digest = hashlib.sha256(
        " ".join([*level.flags, f"py{sys.version_info[0]}.{sys.version_info[1]}", repr(UNITS)]).encode()
    )
    for f in sorted(CSRC.iterdir()):
        digest.update(f.name.encode() + f.read_bytes())
    return (
        default_cache_dir()
        / "kernels"
        / f"torch-{torch.__version__}"
        / f"{level.name}-{digest.hexdigest()[:12]}"
    )


def default_level() -> IsaLevel:
    level = best_level()
    if level is None:
        raise RuntimeError("this CPU has no AVX2; the C++ kernels need at least AVX2")
    return level


@contextlib.contextmanager
def _build_lock(d: Path) -> Iterator[None]:
    """Held while a level is built or loaded, by one process at a time per build folder. PyTorch's own
    lock is a file that a build killed midway (Ctrl-C during a first `make run`) leaves behind, and
    every later load then waits for it forever, silently. This lock is the kernel's (it goes with its
    process), so whoever holds it knows nobody is building, and such a file is stale."""
    if fcntl is None:
        yield
        return
    with open(d / "tokenmill.lock", "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        stale = d / "lock"
        if stale.exists():
            log.warning("removing a build lock left by an interrupted build: %s", stale)
            stale.unlink(missing_ok=True)
        yield


def cpu_kernels(level: str | None = None) -> ModuleType:
    """The compiled extension for `level` (default: the best this CPU runs); RuntimeError if it cannot be
    built or run here."""
    lv = default_level() if level is None else get_level(level)
    if lv.name in _modules:
        return _modules[lv.name]
    if lv.name in _failed:
        raise RuntimeError(_failed[lv.name])
    if not lv.supported():
        raise RuntimeError(f"this CPU cannot run the {lv.name} build of the kernels")
    try:
        d = build_dir(lv)
        d.mkdir(parents=True, exist_ok=True)
        with _build_lock(d):
            module = _load(lv, d)
    except Exception as e:
        _failed[lv.name] = f"could not build the CPU kernels ({lv.name}): {e}"
        raise RuntimeError(_failed[lv.name]) from e
    if module.isa_level() != lv.name:  # the build must be the one its flags say
        raise RuntimeError(f"kernel build mismatch: asked for {lv.name}, got {module.isa_level()}")
    _modules[lv.name] = module
    return module


def _load(lv: IsaLevel, d: Path) -> ModuleType:
    """Import the level's library if the folder holds a finished build, else build it there (in a child
    process that says what it is doing: build.py) and import it.

    The folder is keyed by the sources, the flags and the Python and PyTorch versions, so a finished
    build in it fits any checkout of the same sources in any environment with those versions. It is
    imported as it is: ninja would rebuild it for another checkout or virtualenv, since its commands
    record the source paths and PyTorch's include paths."""
    module = _import_built(lv, d)
    if module is None:
        build(lv.name, d)
        module = _import_built(lv, d)
        if module is None:
            raise RuntimeError(f"the build of {lv.name} left no library in {d}")
    return module


def _import_built(lv: IsaLevel, d: Path) -> ModuleType | None:
    marker = d / BUILT
    if not marker.exists():
        return None
    library = d / marker.read_text().strip()
    spec = importlib.util.spec_from_file_location(module_name(lv.name), library)
    if not library.is_file() or spec is None or spec.loader is None:
        return None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    with contextlib.suppress(OSError):  # its time is the build's last use (`tokenmill cache`)
        os.utime(marker)
    return module
