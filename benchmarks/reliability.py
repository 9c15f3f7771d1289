"""Reliability under worker kills: every request ends, answered or with an error, within the router's
bound, while workers are SIGKILLed at random times (issue 51).

For each setup, a real `tokenmill serve` on 127.0.0.1 with the default model: a local fleet of two
workers behind the KV-aware router (`--workers 2 --router kv`), then prefill/decode disaggregation
(`--workers 2 --disaggregate 1P1D`, with --disagg-min-prefill-tokens low enough that every prompt is
prefilled on the prefill worker, so kills of either worker hit requests in both phases). --concurrency
clients send streaming /v1/completions back to back for --duration seconds (seeded word-salad prompts,
greedy, ignore_eos; a client waits --backoff seconds after an error, as a client would, rather than
flood a fleet with no decode worker up with requests that fail at once). Meanwhile a killer thread
waits for the fleet to be whole (router_workers_up = 2),
waits a random time (seeded), and SIGKILLs one of the worker processes (the server's spawned children),
chosen at random; the fleet restarts it and it rejoins. No kills in the last --quiet-tail seconds.

Every request is recorded as answered (a finish_reason and [DONE]), errored (an HTTP status other than
200, an error event in the stream, or the stream cut off) or hung (not ended within the bound plus
--margin); hung requests are still waited for up to --hard-cap seconds, to tell late from never. Time to
end is from the request sent to its last byte. The bound checked is the router's stated worst case
(tokenmill/cluster/router.py: a request is sent at most 1 + MAX_RETRIES times, each time taken as lost
after lost_after_s of silence, each retry waiting at most retry_wait_s for a worker that answers):
(1 + MAX_RETRIES) x lost_after_s + MAX_RETRIES x retry_wait_s = 50 s with the defaults. Time-to-end
figures are given for the errored requests and for those in flight when a kill landed (sent before it,
ended after it: the ones a retry or an error could concern). Exit status 1 if any request hung.

    python benchmarks/reliability.py [--quick] [--duration 100] [--concurrency 8] [--seed 0]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx
from machine import busy_cpu_s, cpu_description, tree_cpu_s
from served import scrape, serving, workers_up

from tokenmill.cluster.router import MAX_RETRIES, RouterSettings  # noqa: E402

_WORD_LINES = (
    "the a of and to in is that for on with as by at from it this which be are was an or not have has",
    "river city market garden engine signal letter winter harbour valley bridge station library museum",
    "village forest council school factory island mountain railway window kitchen orchard lantern ledger",
    "report budget contract meeting committee archive survey measure record schedule inventory shipment",
)
WORDS = [w for line in _WORD_LINES for w in line.split()]


def stated_bound_s() -> float:
    s = RouterSettings()
    return (1 + MAX_RETRIES) * s.lost_after_s + MAX_RETRIES * s.retry_wait_s


# -- the server and its workers ------------------------------------------------------------------------
def worker_pids(server_pid: int) -> list[int]:
    """The server's worker processes: its children started by multiprocessing's spawn (not its
    resource tracker)."""
    pids = []
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            rest = (d / "stat").read_text().rsplit(")", 1)[1].split()
            cmd = (d / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if int(rest[1]) == server_pid and rest[0] != "Z" and "spawn_main" in cmd:
            pids.append(int(d.name))
    return sorted(pids)


# -- the killer ----------------------------------------------------------------------------------------
@dataclass
class Kill:
    at: float  # time.monotonic()
    role: str
    pid: int
    rejoined_after_s: float | None = None  # router_workers_up back to 2


class Killer(threading.Thread):
    """Waits for the fleet to be whole, waits a random time, SIGKILLs a random worker; until `until`."""

    def __init__(
        self, base: str, server_pid: int, roles: list[str], rng: random.Random, gap: tuple, until: float
    ):
        super().__init__(daemon=True)
        self.base, self.server_pid, self.rng, self.gap, self.until = base, server_pid, rng, gap, until
        pids = worker_pids(server_pid)  # started in order: worker 0 first
        self.role_of = dict(zip(pids, roles, strict=True))
        self.roles = roles
        self.kills: list[Kill] = []
        self.stop = threading.Event()
        self.error: str | None = None

    def whole(self) -> bool:
        try:
            up = workers_up(self.base)
        except httpx.HTTPError:
            return False
        pids = worker_pids(self.server_pid)
        if len(pids) != len(self.roles):
            return False
        new = [p for p in pids if p not in self.role_of]
        if new:  # a restarted worker takes the role of the one that is gone
            gone = [p for p in self.role_of if p not in pids]
            if len(new) != 1 or len(gone) != 1:
                self.error = f"cannot tell roles apart: new {new}, gone {gone}"
                return False
            self.role_of[new[0]] = self.role_of.pop(gone[0])
        return up >= len(self.roles)

    def run(self) -> None:
        while not self.stop.is_set():
            while not self.whole():
                if self.stop.wait(0.25):
                    return
            if self.kills and self.kills[-1].rejoined_after_s is None:
                self.kills[-1].rejoined_after_s = time.monotonic() - self.kills[-1].at
            if self.stop.wait(self.rng.uniform(*self.gap)) or time.monotonic() >= self.until:
                return
            role = self.rng.choice(self.roles)
            pid = next(p for p, r in self.role_of.items() if r == role)
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                continue
            self.kills.append(Kill(time.monotonic(), role, pid))
            print(f"  kill {len(self.kills)}: SIGKILL {role} worker (pid {pid})", flush=True)
            time.sleep(0.5)  # let it be reaped before looking for the fleet to be whole again


# -- the load ------------------------------------------------------------------------------------------
@dataclass
class Record:
    sent: float
    ended: float | None = None
    outcome: str = "hung"  # answered, errored, hung
    detail: str = ""
    tokens: int = 0
    seen: list[str] = field(default_factory=list)  # the last few stream lines (for a hung request)

    @property
    def secs(self) -> float:
        return (self.ended if self.ended is not None else time.monotonic()) - self.sent


async def one_request(c: httpx.AsyncClient, base: str, body: dict, rec: Record) -> None:
    try:
        async with c.stream("POST", f"{base}/v1/completions", json=body) as r:
            if r.status_code != 200:
                rec.outcome, rec.detail = "errored", f"HTTP {r.status_code}: {(await r.aread())[:200]!r}"
                return
            finished = done = False
            async for line in r.aiter_lines():
                if not line.startswith("data:"):
                    continue
                rec.seen = [*rec.seen[-3:], line[:200]]
                data = line[5:].strip()
                if data == "[DONE]":
                    done = True
                    continue
                ev = json.loads(data)
                if "error" in ev:
                    rec.outcome, rec.detail = "errored", f"stream error: {str(ev['error'])[:200]}"
                    continue
                for ch in ev.get("choices", []):
                    rec.tokens += 1 if ch.get("text") else 0
                    finished = finished or ch.get("finish_reason") is not None
            if rec.outcome != "errored":
                if finished and done:
                    rec.outcome = "answered"
                else:
                    rec.outcome, rec.detail = (
                        "errored",
                        f"stream ended early (finish {finished}, [DONE] {done})",
                    )
    except httpx.HTTPError as e:
        rec.outcome, rec.detail = "errored", f"{type(e).__name__}: {e}"
    finally:
        rec.ended = time.monotonic()


async def client(base: str, rng: random.Random, stop: float, args: argparse.Namespace, out: list) -> None:
    timeout = httpx.Timeout(None, connect=10)
    async with httpx.AsyncClient(timeout=timeout) as c:
        while time.monotonic() < stop:
            body = {
                "prompt": " ".join(rng.choice(WORDS) for _ in range(rng.randint(40, 160))),
                "max_tokens": rng.randint(8, args.max_tokens),
                "temperature": 0,
                "ignore_eos": True,
                "stream": True,
            }
            rec = Record(time.monotonic())
            out.append(rec)
            task = asyncio.create_task(one_request(c, base, body, rec))
            try:  # the hard cap only: hung is judged after, against the bound
                await asyncio.wait_for(asyncio.shield(task), args.hard_cap)
            except TimeoutError:
                task.cancel()
                rec.ended, rec.outcome = None, "hung"
                rec.detail = f"not ended after {args.hard_cap:.0f}s (gave up)"
                await asyncio.gather(task, return_exceptions=True)
                rec.ended = None
                return  # this client's connection is in an unknown state: stop it
            if rec.outcome == "errored":
                await asyncio.sleep(args.backoff)  # no flood of instant 503s while no decode worker is up


async def load(base: str, args: argparse.Namespace, seed: int, until: float) -> list[Record]:
    out: list[Record] = []
    rng = random.Random(seed)
    tasks = [
        asyncio.create_task(client(base, random.Random(rng.random()), until, args, out))
        for _ in range(args.concurrency)
    ]
    t0 = last = time.monotonic()
    while not all(t.done() for t in tasks):
        await asyncio.sleep(0.5)
        if time.monotonic() - last >= 10 or all(t.done() for t in tasks):
            last = time.monotonic()
            counts = {
                k: sum(r.outcome == k and r.ended is not None for r in out) for k in ("answered", "errored")
            }
            open_ = sum(r.ended is None for r in out)
            longest = max((r.secs for r in out if r.ended is None), default=0)
            print(
                f"  {time.monotonic() - t0:5.0f}s sent {len(out)} {counts} in flight {open_} "
                f"(longest {longest:.0f}s)",
                flush=True,
            )
    return out


# -- a setup -------------------------------------------------------------------------------------------
def pct(xs: list[float], q: float) -> float:
    if not xs:
        return float("nan")
    xs = sorted(xs)
    return xs[min(len(xs) - 1, round(q * (len(xs) - 1)))]


def run_setup(
    name: str, serve_args: list[str], roles: list[str], args: argparse.Namespace, folder: Path
) -> dict:
    log = folder / f"{name.replace(' ', '_')}.log"
    print(f"\n== {name}: tokenmill serve {' '.join(serve_args)} (log {log})", flush=True)
    t0 = time.monotonic()

    def whole(base: str, proc: subprocess.Popen) -> bool:
        return workers_up(base) >= len(roles) and len(worker_pids(proc.pid)) == len(roles)

    with serving(serve_args, log, whole) as (base, srv):
        print(f"  ready in {time.monotonic() - t0:.0f}s, worker pids {worker_pids(srv.pid)}", flush=True)
        start = time.monotonic()
        until = start + args.duration
        killer = Killer(
            base,
            srv.pid,
            roles,
            random.Random(f"{args.seed}-{name}"),
            (args.min_gap, args.max_gap),
            until - args.quiet_tail,
        )
        cpu0, ours0 = busy_cpu_s(), tree_cpu_s(os.getpid())
        killer.start()
        records = asyncio.run(load(base, args, args.seed, until))
        foreign_s = (busy_cpu_s() - cpu0) - (tree_cpu_s(os.getpid()) - ours0)
        foreign = max(foreign_s, 0.0) / ((time.monotonic() - start) * (os.cpu_count() or 1))
        killer.stop.set()
        killer.join(30)
        # the fleet after the load: whole again? (the last kill's rejoin, for the record)
        deadline = time.monotonic() + 60
        while not killer.whole() and time.monotonic() < deadline:
            time.sleep(0.5)
        if killer.kills and killer.kills[-1].rejoined_after_s is None and killer.whole():
            killer.kills[-1].rejoined_after_s = time.monotonic() - killer.kills[-1].at
        metrics = scrape(base)[0]
        server_alive = srv.poll() is None
    bound = stated_bound_s()
    limit = bound + args.margin
    for r in records:
        if r.ended is not None and r.secs > limit:
            r.detail = f"ended after {r.secs:.1f}s as {r.outcome} ({r.detail}) - beyond the bound + margin"
            r.outcome = "hung"
    kills = [k.at for k in killer.kills]

    def at_a_kill(r: Record) -> bool:
        end = r.ended if r.ended is not None else float("inf")
        return any(r.sent < k < end for k in kills)

    errored = [r for r in records if r.outcome == "errored"]
    affected = [r for r in records if r.outcome != "hung" and (r.outcome == "errored" or at_a_kill(r))]
    hung = [r for r in records if r.outcome == "hung"]
    res = {
        "setup": name,
        "requests": len(records),
        "kills": len(killer.kills),
        "kills_by_role": {role: sum(k.role == role for k in killer.kills) for role in roles},
        "answered": sum(r.outcome == "answered" for r in records),
        "errored": len(errored),
        "hung": len(hung),
        "affected": len(affected),
        "affected_p50": pct([r.secs for r in affected], 0.5),
        "affected_p99": pct([r.secs for r in affected], 0.99),
        "affected_max": max((r.secs for r in affected), default=float("nan")),
        "errored_p50": pct([r.secs for r in errored], 0.5),
        "errored_max": max((r.secs for r in errored), default=float("nan")),
        "all_max": max((r.secs for r in records if r.outcome != "hung"), default=float("nan")),
        "bound": bound,
        "rejoin_s": [round(k.rejoined_after_s, 1) for k in killer.kills if k.rejoined_after_s is not None],
        "retries": metrics.get("tokenmill:router_retries_total", float("nan")),
        "worker_losses": metrics.get("tokenmill:router_worker_losses_total", float("nan")),
        "disaggregated": metrics.get("tokenmill:router_disaggregated_total", float("nan")),
        "disagg_fallbacks": metrics.get("tokenmill:router_disagg_fallbacks_total", float("nan")),
        "foreign_cpu_share": round(foreign, 3),
        "server_alive": server_alive,
        "killer_error": killer.error,
        "log": str(log),
    }
    kinds: dict[str, int] = {}
    for r in errored:
        key = r.detail.split(":", 1)[0] if not r.detail.startswith("stream error") else r.detail[:90]
        kinds[key] = kinds.get(key, 0) + 1
    res["error_kinds"] = kinds
    print(f"  {name}: {json.dumps({k: v for k, v in res.items() if k != 'log'})}", flush=True)
    for r in hung:
        print(f"  HUNG: sent at +{r.sent - start:.1f}s, {r.detail}; last stream lines: {r.seen}", flush=True)
    if hung:
        print(f"  server log tail ({log}):\n{log.read_text()[-3000:]}", flush=True)
    return res


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="shorter: --duration 20, about 1.5 min in all")
    ap.add_argument("--duration", type=float, default=100.0, help="seconds of load per setup")
    ap.add_argument("--concurrency", type=int, default=8, help="streaming clients, back to back")
    ap.add_argument("--max-tokens", type=int, default=48, help="each request asks 8..this many tokens")
    ap.add_argument(
        "--min-gap", type=float, default=3.0, help="kills: seconds after the fleet is whole, at least"
    )
    ap.add_argument("--max-gap", type=float, default=12.0, help="... at most (uniform)")
    ap.add_argument("--quiet-tail", type=float, default=5.0, help="no kill in the load's last seconds")
    ap.add_argument("--margin", type=float, default=10.0, help="hung: not ended within the bound + this")
    ap.add_argument("--hard-cap", type=float, default=120.0, help="give up on a request after this")
    ap.add_argument("--backoff", type=float, default=1.0, help="a client waits this long after an error")
    ap.add_argument("--setups", default="fleet,1p1d", help="comma-separated: fleet, 1p1d")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--log-dir", help="keep the server logs here (default: a temporary folder)")
    args = ap.parse_args()
    if args.quick:
        args.duration = min(args.duration, 20.0)
        args.min_gap, args.max_gap = min(args.min_gap, 2.0), min(args.max_gap, 6.0)
    print(f"machine: {cpu_description()}")
    print(
        f"load: {args.concurrency} streaming clients back to back for {args.duration:.0f}s per setup; kills "
        f"{args.min_gap:g}-{args.max_gap:g}s after the fleet is whole; bound {stated_bound_s():g}s "
        f"(+{args.margin:g}s margin); seed {args.seed}",
        flush=True,
    )
    common = ["--max-model-len", "1024"]
    setups = {
        "fleet": ("local fleet 2 workers, kv", ["--workers", "2", "--router", "kv", *common], ["w0", "w1"]),
        "1p1d": (
            "1P1D",
            [
                "--workers",
                "2",
                "--router",
                "kv",
                "--disaggregate",
                "1P1D",
                "--disagg-min-prefill-tokens",
                "32",
            ]
            + common,
            ["prefill", "decode"],
        ),
    }
    results = []
    with tempfile.TemporaryDirectory(prefix="reliability_") as tmp:
        folder = Path(args.log_dir) if args.log_dir else Path(tmp)
        folder.mkdir(parents=True, exist_ok=True)
        for key in args.setups.split(","):
            name, serve_args, roles = setups[key.strip()]
            results.append(run_setup(name, serve_args, roles, args, folder))

    print(f"\nmachine: {cpu_description()}")
    print(
        "time to end: from the request sent to its last byte, for the requests that errored or were in "
        "flight when a kill landed (p50 / p99 / max); bound: the router's stated worst case"
    )
    print(
        "\n| setup | requests | kills | answered | errored | hung | in flight at a kill or errored | "
        "time to end p50 / p99 / max (s) | slowest request (s) | bound (s) | router retries | rejoin (s) |"
    )
    print("|---|---:|---:|---:|---:|---:|---:|---|---:|---:|---:|---|")
    for r in results:
        rejoin = f"{statistics.median(r['rejoin_s']):.1f} median" if r["rejoin_s"] else "-"
        kills = ", ".join(f"{n} {role}" for role, n in r["kills_by_role"].items())
        print(
            f"| {r['setup']} | {r['requests']} | {r['kills']} ({kills}) | {r['answered']} | {r['errored']} | "
            f"**{r['hung']}** | {r['affected']} | {r['affected_p50']:.1f} / {r['affected_p99']:.1f} / "
            f"{r['affected_max']:.1f} | {r['all_max']:.1f} | {r['bound']:g} | {r['retries']:.0f} | {rejoin} |"
        )
    for r in results:
        flag = (
            "  <-- DISTURBED: other processes competed for the cores" if r["foreign_cpu_share"] > 0.05 else ""
        )
        print(
            f"{r['setup']}: other processes used {r['foreign_cpu_share']:.0%} of the machine during the "
            f"load{flag}"
        )
        if r["error_kinds"]:
            print(f"{r['setup']} errors: {r['error_kinds']}")
        if not r["server_alive"] or r["killer_error"]:
            print(f"{r['setup']}: server alive {r['server_alive']}, killer: {r['killer_error']}")
    sys.exit(1 if any(r["hung"] for r in results) else 0)


if __name__ == "__main__":
    main()
