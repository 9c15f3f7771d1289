"""Compiling one instruction-set level of the C++ kernels, in a process of its own.

The build runs as `python -m tokenmill.kernels.build LEVEL DIR`, a child of whoever needs the kernels
(the engine, `tokenmill kernels`, a test), for two reasons:

- it can be stopped with its caller: the child leads a process group of its own (ninja and the compilers
  under it) and asks the kernel to signal it when its parent dies (Linux's PR_SET_PDEATHSIG), so a
  server killed during its first start (by a readiness probe, say) takes its compilers with it rather
  than leaving them running for minutes;
- it says what it is doing: a line per compiled source with a counter on stderr, so a first start is
  not minutes of silence.

Only bindings.cpp includes <torch/extension.h>; the kernels include the light headers of csrc/tensor.h
(docs/history/benchmarks.md has the build's time).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

# The sources, compiled as five translation units rather than fifteen: each unit parses torch's headers
# once (~6 s a file of the 10-30 each took alone), and bindings.cpp (torch/extension.h, the longest)
# runs beside the others. Files in one unit share no names, and the decode step, whose bits must equal
# the Python loop's calls of the same kernels, is a unit of its own: no kernel is inlined into it.
UNITS: dict[str, list[str]] = {
    "bindings": ["bindings.cpp"],
    "core": [
        "paged_decode.cpp",
        "fused_ops.cpp",
        "quantize.cpp",
        "sample.cpp",
        "argmax.cpp",
        "lora_delta.cpp",
        "kv_write.cpp",
        "prefill_attention.cpp",
    ],
    "panels_a": ["panel_matmul.cpp", "panel_q4.cpp", "panel_i8.cpp", "panel_f8.cpp"],
    "panels_b": ["panel_g8.cpp", "panel_q8.cpp", "panel_wide.cpp", "panel_q4_wide.cpp", "panel_g8_wide.cpp"],
    "decode_step": ["decode_step.cpp"],
}
SOURCES = [s for files in UNITS.values() for s in files]
CSRC = Path(__file__).parent / "csrc"
BUILT = "built"  # names the library once a build in the folder has loaded and checked
LOG = "build.log"  # the compiler's output of a failed build


def module_name(level: str) -> str:
    return f"tokenmill_cpu_kernels_{level}"


def say(line: str) -> None:
    print(f"tokenmill: {line}", file=sys.stderr, flush=True)


def build(level: str, d: Path) -> None:
    """Build `level` into `d` in a child process (the caller holds the folder's lock); RuntimeError with
    the compiler's last lines if it fails. KeyboardInterrupt or SystemExit here stop the child too."""
    child = subprocess.Popen(
        # Not `-m`: the package imports this module first, and runpy warns of that.
        [sys.executable, "-c", "from tokenmill.kernels.build import main; main()", level, str(d)],
        stdin=subprocess.DEVNULL,
        start_new_session=True,  # its own group: ninja and the compilers go with it
        preexec_fn=_die_with_parent if sys.platform.startswith("linux") else None,  # noqa: PLW1509
    )
    try:
        code = child.wait()
    except BaseException:
        _stop(child)
        raise
    if code != 0:
        log = d / LOG
        tail = log.read_text(errors="replace").strip().splitlines()[-12:] if log.exists() else []
        raise RuntimeError("the C++ build failed" + (": " + "\n".join(tail) if tail else f" (exit {code})"))


def _die_with_parent() -> None:
    """In the child before it runs: SIGTERM it when the process that started it dies, however it dies."""
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


def _stop(child: subprocess.Popen[bytes]) -> None:
    if child.poll() is None:
        child.terminate()  # its handler stops its group
        try:
            child.wait(timeout=10)
        except subprocess.TimeoutExpired:
            os.killpg(child.pid, signal.SIGKILL)
            child.wait()


def _stop_group(signum: int, _frame: object) -> None:
    """SIGTERM or SIGINT in the child: stop ninja and the compilers (this process's group), then exit.
    ninja passes the signal on to the compilers it runs, each in a group of its own."""
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    os.killpg(0, signal.SIGTERM)
    os._exit(128 + signum)


def _watch(d: Path, total: int, done: threading.Event) -> None:
    """A line per object file as ninja writes it: what a first start is doing, and how far along."""
    t0, seen = time.perf_counter(), {p.name for p in d.glob("*.o")}
    while not done.wait(0.5):
        for p in sorted(d.glob("*.o"), key=lambda p: p.stat().st_mtime):
            if p.name not in seen:
                seen.add(p.name)
                say(f"[{len(seen)}/{total}] compiled {p.stem} ({time.perf_counter() - t0:.0f} s)")


def _unit(d: Path, name: str, files: list[str]) -> Path:
    """The unit's source in the build folder: the files it takes, included by their paths."""
    if files == [f"{name}.cpp"]:
        return CSRC / files[0]
    unit = d / f"{name}.cpp"
    text = "".join(f'#include "{CSRC / f}"\n' for f in files)
    if not unit.exists() or unit.read_text() != text:  # rewritten only on change: ninja goes by mtime
        unit.write_text(text)
    return unit


def compile_level(level: str, d: Path) -> None:
    """What the child does: compile and link with ninja (through torch.utils.cpp_extension), import the
    library once to check it, and name it in the folder's marker."""
    from torch.utils.cpp_extension import load

    from tokenmill.kernels.isa import get_level

    lv = get_level(level)
    # ninja's default of cores + 2 jobs only makes the compilers take turns; MAX_JOBS is PyTorch's knob.
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    jobs = os.environ.get("MAX_JOBS") or str(cores)
    os.environ["MAX_JOBS"] = jobs
    say(
        f"building the CPU kernels ({level}) once for this machine: {len(SOURCES)} sources in {len(UNITS)} "
        f"units, {jobs} at a time"
    )
    t0, done = time.perf_counter(), threading.Event()
    watcher = threading.Thread(target=_watch, args=(d, len(UNITS), done), daemon=True)
    watcher.start()
    try:
        module = load(
            name=module_name(level),
            sources=[str(_unit(d, name, files)) for name, files in UNITS.items()],
            # PyTorch's own flags for its kernels: no errno or FP-exception side effects, which is what
            # lets GCC vectorize rounding and min/max loops. Not -ffast-math: the order of float sums
            # stays the code's.
            extra_cflags=["-O3", "-fopenmp", "-fno-math-errno", "-fno-trapping-math", *lv.flags],
            extra_ldflags=["-fopenmp"],
            build_directory=str(d),
            verbose=False,
        )
    finally:
        done.set()
        watcher.join()
    if module.isa_level() != level or not module.__file__:
        raise RuntimeError(f"kernel build mismatch: asked for {level}, got {module.isa_level()}")
    tmp = d / f"{BUILT}.{os.getpid()}.tmp"
    tmp.write_text(Path(module.__file__).name + "\n")
    tmp.replace(d / BUILT)  # whole or absent
    say(f"CPU kernels ({level}) built in {time.perf_counter() - t0:.0f} s")


def main() -> None:
    level, d = sys.argv[-2], Path(sys.argv[-1])
    signal.signal(signal.SIGTERM, _stop_group)
    signal.signal(signal.SIGINT, _stop_group)
    try:
        compile_level(level, d)
    except Exception as e:  # the compiler's output goes to the log; the caller shows its last lines
        (d / LOG).write_text(f"{e}\n")
        say(f"the CPU kernel build ({level}) failed; compiler output in {d / LOG}")
        sys.exit(1)


if __name__ == "__main__":
    main()
