"""From `make run` in a fresh clone to the first answer, as a new user meets it.

Clones this repository (its committed HEAD) into a temporary folder, runs `make run PORT=...` there with
empty caches of its own (XDG_CACHE_HOME: pip's downloads, the model's weights, the kernel builds), and
sends a chat request every second until one is answered. Prints each line `make run` printed with the
seconds at which it came, and records the time to the first answer (benchmarks/results/first_answer.jsonl,
read by the figures page).

    python benchmarks/first_answer.py                 # fresh caches
    python benchmarks/first_answer.py --keep-caches   # this user's caches (a second clone on one machine)
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
import results_log  # noqa: E402
from server_fixture import free_port  # noqa: E402

REPO = Path(__file__).resolve().parent.parent
QUESTION = {"model": "smollm2-135m", "messages": [{"role": "user", "content": "Hello!"}], "max_tokens": 16}


def answered(base: str) -> str | None:
    """The reply's text once the server answers, else None (not listening yet, loading, or an error)."""
    try:
        r = httpx.post(f"{base}/v1/chat/completions", json=QUESTION, timeout=30)
    except httpx.HTTPError:
        return None
    if r.status_code != 200:
        return None
    return r.json()["choices"][0]["message"]["content"]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--keep-caches", action="store_true", help="use this user's caches, not empty ones")
    ap.add_argument("--timeout-s", type=float, default=1800.0, help="give up after this long")
    results_log.add_flag(ap)
    args = ap.parse_args()

    work = Path(tempfile.mkdtemp(prefix="tokenmill-first-"))
    clone = work / "tokenmill"
    subprocess.run(["git", "clone", "-q", str(REPO), str(clone)], check=True)
    env = dict(os.environ)
    if not args.keep_caches:
        env["XDG_CACHE_HOME"] = str(work / "cache")
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    lines: list[tuple[float, str]] = []
    start = time.monotonic()
    proc = subprocess.Popen(
        ["make", "run", f"PORT={port}"], cwd=clone, env=env, text=True,
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True,
    )  # fmt: skip

    def read() -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            lines.append((time.monotonic() - start, line.rstrip()))
            print(f"{lines[-1][0]:7.1f} s  {lines[-1][1]}", flush=True)

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    reply = None
    try:
        while time.monotonic() - start < args.timeout_s and proc.poll() is None:
            reply = answered(base)
            if reply is not None:
                break
            time.sleep(1.0)
    finally:
        seconds = time.monotonic() - start
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGTERM)
            proc.wait(timeout=60)
        reader.join(timeout=5)
    if reply is None:
        print(f"no answer after {seconds:.0f} s (make run exited {proc.returncode})", file=sys.stderr)
        return 1
    print(f"first answer after {seconds:.1f} s: {reply!r}")
    # Each step's start, from the lines `make run` prints ("==> [k/4] ...").
    steps = {text.split("]", 1)[0].removeprefix("==> ["): t for t, text in lines if text.startswith("==> [")}
    metrics: dict[str, results_log.Metric] = {"seconds_to_first_answer": round(seconds, 1)}
    metrics |= {f"seconds_at_step_{k.replace('/', '_of_')}": round(t, 1) for k, t in steps.items()}
    caches = "this user's caches" if args.keep_caches else "empty caches, packages downloaded"
    head = subprocess.run(
        ["git", "-C", str(clone), "rev-parse", "--short", "HEAD"], capture_output=True, text=True
    )
    results_log.record(
        "first_answer", metrics, args=args, notes=f"fresh clone, {caches}", commit=head.stdout.strip()
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
