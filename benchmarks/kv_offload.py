"""KV offload tiers against recomputing: TTFT of later turns of multi-turn conversations whose KV
exceeds the engine's pool several times, and a restart with a warm disk tier against a cold one.

C conversations of T turns each (turn 1: a ~1000-1500-token document and a question; each later turn:
the previous prompt, its answer and a new question) run round-robin, one request at a time, on a pool
that holds about 1.5 conversations: when a conversation comes back, its blocks have left the pool.
Each configuration is a fresh engine: `recompute` (no tiers), `host` (a host tier that holds
everything), `disk` (a disk tier only), `host+disk` (a host tier the size of the pool, then disk).
The recompute run is the baseline, measured in the same run: every configuration replays its exact
prompts (history = its answers), and its greedy outputs are the reference. The goal: TTFT p50 of turns
>= 2 at least 2x lower with offload than recomputing.

Warm restart: turns 1..T-1 in an engine with a disk tier, close() (the pool and host tier go to the
disk), then turn T of every conversation in a new engine on the same directory, against a new engine
on an empty directory.

    python benchmarks/kv_offload.py [--conversations 8] [--turns 4] [--context-tokens 1200] [--repeats 3]
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

from machine import cpu_description
from results_log import add_flag, record

from tokenmill import LLM, SamplingParams
from tokenmill.tokenizer.tokenizer import Tokenizer
from tokenmill.weights import catalog
from tokenmill.weights.tokenizer_source import load_tokenizer

_WORD_LINES = (
    "the a of and to in is that for on with as by at from it this which be are was an or not have has",
    "river city market garden engine signal letter winter harbour valley bridge station library museum",
    "village forest council school factory island mountain railway window kitchen orchard lantern ledger",
    "report budget contract meeting committee archive survey measure record schedule inventory shipment",
    "customer supplier teacher student farmer captain doctor engineer clerk painter baker merchant sailor",
    "north south eastern western old new small large quiet busy early late careful rapid narrow broad",
    "wooden iron silver golden ancient modern public private local regional annual monthly weekly daily",
    "built opened closed moved carried counted repaired painted measured signed delivered recorded planned",
    "divided shared raised lowered checked answered described reported visited followed replaced",
    "because although after before while during since until unless whereas however therefore meanwhile",
    "three four seven twelve twenty hundred thousand several many few most every each other another",
)
WORDS = [w for line in _WORD_LINES for w in line.split()]
ASKS = [
    "What does the document say about",
    "Summarise what we know about",
    "How is the following connected to the rest:",
    "Compare what the text reports on",
    "Explain in two sentences the part about",
    "List the facts the document gives on",
]
BLOCK = 16


def filesystem_of(path: str) -> str:
    """The type of the filesystem `path` is on (the disk tier on tmpfs is memory, not a disk)."""
    best, fstype, real = "", "?", os.path.realpath(path)
    try:
        for line in Path("/proc/mounts").read_text().splitlines():
            mount, kind = line.split()[1:3]
            if (real == mount or real.startswith(mount.rstrip("/") + "/")) and len(mount) > len(best):
                best, fstype = mount, kind
    except OSError:
        pass
    return fstype


def sentence(rng: random.Random, lo: int, hi: int) -> str:
    words = [rng.choice(WORDS) for _ in range(rng.randint(lo, hi))]
    if rng.random() < 0.3:
        words.insert(rng.randrange(1, len(words)), str(rng.randint(2, 2000)))
    return " ".join(words).capitalize() + "."


def document(rng: random.Random, tok: Tokenizer, n_tokens: int) -> str:
    """Paragraphs of sentences of seeded words, about `n_tokens` tokens long."""
    paragraphs: list[list[str]] = [[]]
    count = 0
    while count < n_tokens:
        s = sentence(rng, 6, 16)
        paragraphs[-1].append(s)
        count += len(tok.encode(" " + s, add_special_tokens=False))
        if len(paragraphs[-1]) >= rng.randint(3, 6):
            paragraphs.append([])
    return "\n\n".join(" ".join(p) for p in paragraphs if p)


def question(rng: random.Random, tok: Tokenizer) -> str:
    """A user question of 30-60 tokens."""
    target = rng.randint(30, 60)
    text = f"{rng.choice(ASKS)} the {rng.choice([w for w in WORDS if len(w) > 5])}?"
    while len(tok.encode(text, add_special_tokens=False)) < target:
        text += " " + sentence(rng, 4, 10)
    return text


@dataclass
class Conversation:
    first: list[int]  # turn 1's prompt
    follow_ups: list[list[int]]  # what each later turn adds after the previous answer

    def prompt(self, turn: int, answers: list[list[int]]) -> list[int]:
        """Turn `turn` (0-based): turn 1 + (answer, next question) of every turn before it."""
        ids = list(self.first)
        for t in range(turn):
            ids += answers[t] + self.follow_ups[t]
        return ids


def conversations(tok: Tokenizer, args: argparse.Namespace) -> list[Conversation]:
    out = []
    for c in range(args.conversations):
        rng = random.Random(args.seed * 1000 + c)
        n = int(args.context_tokens * rng.uniform(0.85, 1.2))
        first = tok.encode(
            "System: You are a careful assistant. Answer questions about the document below.\n\n"
            f"Document {c + 1}:\n{document(rng, tok, n)}\n\nUser: {question(rng, tok)}\nAssistant:"
        )
        follow = [
            tok.encode(f"\n\nUser: {question(rng, tok)}\nAssistant:", add_special_tokens=False)
            for _ in range(args.turns - 1)
        ]
        out.append(Conversation(first, follow))
    return out


@dataclass
class Run:
    ttft: dict[tuple[int, int], float] = field(default_factory=dict)  # (conversation, turn) -> s
    cached: dict[tuple[int, int], float] = field(default_factory=dict)  # share of the prompt cached
    answers: dict[tuple[int, int], list[int]] = field(default_factory=dict)
    counters: dict[str, int] = field(default_factory=dict)
    block_bytes: int = 0

    def ttfts(self, later: bool) -> list[float]:
        return [v for (_, t), v in self.ttft.items() if (t > 0) == later]


def percentile(xs: list[float], q: float) -> float:
    s = sorted(xs)
    if not s:
        return float("nan")
    pos = (len(s) - 1) * q
    lo = int(pos)
    hi = min(lo + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (pos - lo)


def play(llm: LLM, convs: list[Conversation], turns: range, ref: list[list[list[int]]], run: Run,
         max_tokens: int) -> None:  # fmt: skip
    """Turns `turns` of every conversation, round-robin, one request at a time. `ref`: each conversation's
    answers so far, the history of later prompts (this run's own answers are appended when it has none)."""
    params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
    for t in turns:
        for c, conv in enumerate(convs):
            prompt = conv.prompt(t, ref[c])
            out = llm.generate([prompt], params)[0]
            comp = out.outputs[0]
            if comp.finish_reason not in ("length", "stop"):
                raise RuntimeError(f"conversation {c} turn {t + 1} ended with {comp.finish_reason!r}")
            assert comp.metrics is not None and comp.metrics.ttft is not None
            run.ttft[c, t] = comp.metrics.ttft
            run.cached[c, t] = out.num_cached_tokens / len(prompt)
            run.answers[c, t] = list(comp.token_ids)
            if len(ref[c]) == t:
                ref[c].append(list(comp.token_ids))


def engine(args: argparse.Namespace, spec: str | None, warm_up: list[list[int]]) -> LLM:
    """A fresh engine, past its first forward passes (prompts unrelated to the conversations')."""
    kw = {"kv_offload": spec} if spec else {}
    llm = LLM(
        args.model, dtype=args.dtype, max_model_len=args.max_model_len, num_blocks=args.pool_blocks, **kw
    )
    for ids in warm_up:
        llm.generate([ids], SamplingParams(max_tokens=4, temperature=0, ignore_eos=True))
    return llm


def collect(llm: LLM, run: Run) -> None:
    st = llm.engine.stats()
    run.counters = {"prefix_cache_hits": st.prefix_cache_hits, **st.kv_connector}


def tier_spec(name: str, args: argparse.Namespace, directory: str) -> str | None:
    if name == "host":
        return f"host={args.host_bytes}"
    if name == "disk":
        return f"disk={directory}:{args.disk_bytes}"
    if name == "host+disk":
        return f"host={args.small_host_bytes},disk={directory}:{args.disk_bytes}"
    return None  # recompute


def run_config(name: str, args: argparse.Namespace, convs: list[Conversation], ref: list[list[list[int]]],
               warm_up: list[list[int]]) -> Run:  # fmt: skip
    """All turns of every conversation in a fresh engine with configuration `name`."""
    run = Run()
    with tempfile.TemporaryDirectory(prefix="kv_offload_", dir=args.tmpdir) as tmp:
        llm = engine(args, tier_spec(name, args, tmp), warm_up)
        try:
            run.block_bytes = llm.engine.executor.kv_cache_specs(BLOCK)[0].block_bytes
            play(llm, convs, range(args.turns), ref, run, args.max_tokens)
            collect(llm, run)
        finally:
            llm.close()
    return run


def restart(args: argparse.Namespace, convs: list[Conversation], ref: list[list[list[int]]],
            warm_up: list[list[int]]) -> tuple[Run, Run]:  # fmt: skip
    """Turn T in a new engine on the disk directory the first T-1 turns left (warm), and in one on an
    empty directory (cold)."""
    last = range(args.turns - 1, args.turns)
    warm, cold = Run(), Run()
    with (
        tempfile.TemporaryDirectory(prefix="kv_offload_warm_", dir=args.tmpdir) as warm_dir,
        tempfile.TemporaryDirectory(prefix="kv_offload_cold_", dir=args.tmpdir) as cold_dir,
    ):
        llm = engine(args, tier_spec("disk", args, warm_dir), warm_up)
        try:
            play(llm, convs, range(args.turns - 1), ref, Run(), args.max_tokens)
        finally:
            llm.close()  # writes the pool's blocks to the disk tier
        for run, d in ((cold, cold_dir), (warm, warm_dir)):
            llm = engine(args, tier_spec("disk", args, d), warm_up)
            try:
                play(llm, convs, last, ref, run, args.max_tokens)
                collect(llm, run)
            finally:
                llm.close()
    return warm, cold


def same_outputs(run: Run, ref: list[list[list[int]]]) -> tuple[int, int]:
    same = sum(ids == ref[c][t] for (c, t), ids in run.answers.items())
    return same, len(run.answers)


COUNTERS = ("prefix_cache_hits", "host_hit_blocks", "host_loads", "file_loaded_blocks", "disk_hits",
            "host_saved_blocks", "file_saved_blocks", "file_writes", "save_skipped_blocks",
            "file_write_drops", "file_load_failures", "corrupt_blocks")  # fmt: skip


def counter_line(c: dict[str, int]) -> str:
    return " ".join(f"{k}={c[k]}" for k in COUNTERS if c.get(k))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--conversations", type=int, default=8)
    ap.add_argument("--turns", type=int, default=4)
    ap.add_argument("--context-tokens", type=int, default=1200, help="turn 1's document (x0.85-1.2)")
    ap.add_argument("--max-tokens", type=int, default=16, help="answer tokens of every turn (ignore_eos)")
    ap.add_argument("--pool-blocks", type=int, help="engine pool in blocks (default: ~1.5 conversations)")
    ap.add_argument("--configs", default="recompute,host,disk,host+disk")
    ap.add_argument("--repeats", type=int, default=3, help="runs of each configuration (medians)")
    ap.add_argument("--skip-restart", action="store_true", help="no warm/cold restart measurement")
    ap.add_argument("--tmpdir", help="where the disk tiers' directories go (default: the system's temp dir)")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--model", default=catalog.DEFAULT_MODEL)
    ap.add_argument("--seed", type=int, default=0)
    add_flag(ap)
    args = ap.parse_args()
    configs = [c for c in args.configs.split(",") if c and c != "recompute"]
    if unknown := set(configs) - {"host", "disk", "host+disk"}:
        ap.error(f"unknown configurations {sorted(unknown)}; use recompute, host, disk, host+disk")

    tok = load_tokenizer(catalog.resolve(args.model), None)
    convs = conversations(tok, args)
    # Answers are exactly max_tokens long, so every prompt's length is known before any run.
    longest = [len(cv.prompt(args.turns - 1, [[0] * args.max_tokens] * args.turns)) + args.max_tokens
               for cv in convs]  # fmt: skip
    conv_blocks = [-(-n // BLOCK) for n in longest]
    args.max_model_len = max(conv_blocks) * BLOCK
    args.pool_blocks = max(args.pool_blocks or round(1.5 * max(conv_blocks)), max(conv_blocks))
    # Warm-up prompts as long as a first turn, unrelated to the conversations.
    warm_up = [tok.encode(document(random.Random(-1 - i), tok, args.context_tokens)) for i in range(2)]

    print(f"CPU: {cpu_description()}; load average {os.getloadavg()[0]:.2f}")
    tmp_root = args.tmpdir or tempfile.gettempdir()
    print(f"model {args.model}, {args.dtype}; disk tier in {tmp_root} ({filesystem_of(tmp_root)})")
    print(f"{args.conversations} conversations x {args.turns} turns, one request at a time, round-robin; "
          f"turn 1 {min(len(c.first) for c in convs)}-{max(len(c.first) for c in convs)} tokens, "
          f"longest context {max(longest)} tokens; {args.max_tokens} answer tokens per turn")  # fmt: skip
    print(f"pool {args.pool_blocks} blocks of {BLOCK} tokens; KV of all conversations {sum(conv_blocks)} "
          f"blocks = {sum(conv_blocks) / args.pool_blocks:.1f}x the pool")  # fmt: skip

    ref: list[list[list[int]]] = [[] for _ in convs]  # the recompute run's answers: every run's history
    runs: dict[str, list[Run]] = {name: [] for name in ["recompute", *configs]}
    for rep in range(args.repeats):
        for name in runs:
            runs[name].append(run_config(name, args, convs, ref, warm_up))
            if name == "recompute" and rep == 0:  # host tiers in whole blocks: the first run tells their size
                block_bytes, total = runs[name][0].block_bytes, sum(conv_blocks) + 64
                args.host_bytes = total * block_bytes
                args.small_host_bytes = args.pool_blocks * block_bytes
                args.disk_bytes = 2 * total * block_bytes
                print(f"block {block_bytes / 1e6:.2f} MB; host tier {args.host_bytes / 1e6:.0f} MB "
                      f"(host+disk: {args.small_host_bytes / 1e6:.0f} MB, the pool's size), disk tier "
                      f"{args.disk_bytes / 1e6:.0f} MB", flush=True)  # fmt: skip

    def p50(run: Run, later: bool = True) -> float:
        return statistics.median(run.ttfts(later))

    base = statistics.median(p50(r) for r in runs["recompute"])
    figures: dict[str, float] = {}
    print(f"\nTTFT ms, median of {args.repeats} run(s); ratio: recompute p50 / p50, turns >= 2 (goal >= 2x)")
    print(f"{'config':10} {'turn1 p50':>9} {'later p50':>9} {'later p90':>9} {'ratio':>6} {'cached':>6} "
          f"{'identical':>9}  counters (last run)")  # fmt: skip
    for name, rs in runs.items():
        first = statistics.median(p50(r, later=False) for r in rs) * 1e3
        late = statistics.median(p50(r) for r in rs)
        p90 = statistics.median(percentile(r.ttfts(True), 0.9) for r in rs) * 1e3
        cached = statistics.mean(v for r in rs for (_, t), v in r.cached.items() if t > 0)
        same = [same_outputs(r, ref) for r in rs]
        ident = f"{sum(s for s, _ in same)}/{sum(n for _, n in same)}"
        figures[f"{name}_ttft_speedup"] = round(base / late, 3)
        print(f"{name:10} {first:9.1f} {late * 1e3:9.1f} {p90:9.1f} {base / late:6.2f} {cached:6.0%} "
              f"{ident:>9}  {counter_line(rs[-1].counters)}", flush=True)  # fmt: skip

    if args.skip_restart or args.turns < 2:
        record("kv_offload", figures, args=args)
        return
    print(f"\nrestart: turns 1..{args.turns - 1} in an engine with a disk tier, close(), then turn "
          f"{args.turns} of every conversation in a new engine, on that directory (warm) or an empty one "
          "(cold); ratio: cold p50 / p50")  # fmt: skip
    pairs = [restart(args, convs, ref, warm_up) for _ in range(args.repeats)]
    print(f"{'start':10} {'p50':>9} {'p90':>9} {'ratio':>6} {'cached':>6} {'identical':>9}  counters (last)")
    cold50 = statistics.median(p50(c) for _, c in pairs)
    for label, rs in (("cold", [c for _, c in pairs]), ("warm", [w for w, _ in pairs])):
        late = statistics.median(p50(r) for r in rs)
        p90 = statistics.median(percentile(r.ttfts(True), 0.9) for r in rs) * 1e3
        cached = statistics.mean(v for r in rs for v in r.cached.values())
        same = [same_outputs(r, ref) for r in rs]
        ident = f"{sum(s for s, _ in same)}/{sum(n for _, n in same)}"
        figures[f"{label}_restart_ttft_speedup"] = round(cold50 / late, 3)
        print(f"{label:10} {late * 1e3:9.1f} {p90:9.1f} {cold50 / late:6.2f} {cached:6.0%} {ident:>9}  "
              f"{counter_line(rs[-1].counters)}", flush=True)  # fmt: skip
    record("kv_offload", figures, args=args)


if __name__ == "__main__":
    main()
