"""Expert parallelism against tensor parallelism on a mixture of experts, measured and as the sizing tool
predicts it: the check of the sizing model's EP term (tokenmill/sizing/roofline.py).

A random Mixtral (benchmarks/moe.py's shape) runs on two rank processes twice: each expert's columns split
over the ranks (TP 2), then whole experts per rank (TP 2 with --enable-expert-parallel). A decode step's
time is measured at 1 and 16 sequences as (time to N tokens - time to 1 token) / (N - 1), and the EP/TP
ratio of those times is set beside the sizing model's ratio for the same shape and batch. The model says
EP reads more at a few sequences (a token's experts can all sit on one rank, and the step waits for the
busiest) and the same at many (every expert touched); both splits sum the layer with one all-reduce, so
the communication term is left out of the ratio (this VM's link between processes is not in the sizing
catalog).

    python benchmarks/moe_parallel.py [--layers 4] [--new-tokens 32] [--quick]
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from machine import cpu_description  # noqa: E402
from moe import QUICK, hf_config, make_model  # noqa: E402
from results_log import Metric, add_flag, record  # noqa: E402
from rich.console import Console  # noqa: E402
from rich.table import Table  # noqa: E402

from tokenmill import LLM, SamplingParams  # noqa: E402
from tokenmill.sizing.arch import from_config_json  # noqa: E402
from tokenmill.sizing.hardware import CATALOG, default_factors  # noqa: E402
from tokenmill.sizing.roofline import Deployment  # noqa: E402

PROMPT_LEN = 32
BATCHES = (1, 16)


def step_seconds(llm: LLM, seqs: int, new: int, reps: int) -> float:
    """A decode step's time at `seqs` sequences: the time to `new` tokens less the time to the first,
    over the steps between (best of `reps`: the least disturbed by a neighbour)."""
    prompts = [[100 + (7 * i + j) % 40000 for j in range(PROMPT_LEN)] for i in range(seqs)]

    def run(n: int) -> float:
        t0 = time.perf_counter()
        llm.generate(prompts, SamplingParams(temperature=0, max_tokens=n, ignore_eos=True), use_tqdm=False)
        return time.perf_counter() - t0

    run(2)  # warm-up
    return min((run(new) - run(1)) / (new - 1) for _ in range(reps))


def predicted_step(path: Path, ep: bool, seqs: int, ctx: float) -> float:
    """The sizing model's decode step on this VM's entry, its communication term left out (see above)."""
    gpu = dataclasses.replace(CATALOG["cpu-2c"], link_gbs=1e9)
    factors = dataclasses.replace(default_factors("cpu-2c", "bf16"), allreduce_latency_s=0.0)
    d = Deployment(from_config_json(path / "config.json"), gpu, "bf16", factors, tp=2, ep=ep)
    return d.decode_step_s(seqs, ctx)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--rounds", type=int, default=2, help="engine starts per split, in alternating order")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--quick", action="store_true", help="a tiny shape: a smoke test, not recorded")
    add_flag(ap)
    args = ap.parse_args()
    shape = {
        "hidden": 1024, "expert_intermediate": 2816, "heads": 16, "kv_heads": 4, "experts": 8, "top_k": 2,
    }  # fmt: skip
    if args.quick:
        shape |= {k: QUICK[k] for k in ("hidden", "expert_intermediate", "heads", "kv_heads")}
        args.layers, args.new_tokens, args.reps, args.rounds = 2, 8, 1, 1
    cfg_args = argparse.Namespace(layers=args.layers, **shape)
    console = Console()
    console.print(f"CPU: {cpu_description()}")
    res: dict[str, Metric] = {"layers": args.layers, "new_tokens": args.new_tokens, "rounds": args.rounds}
    with tempfile.TemporaryDirectory(prefix="tokenmill-moe-ep-") as tmp:
        path = Path(tmp)
        make_model(hf_config(cfg_args), path, args.seed)
        measured: dict[tuple[str, int], float] = {}
        # Rounds in alternating order, the best of each kept: the engine measured second ran slower
        # whichever it was (0.89x the other way round), so neither may always go second.
        for r in range(args.rounds):
            for mode in ("tp", "ep") if r % 2 == 0 else ("ep", "tp"):
                split = {"tensor_parallel_size": 2, "enable_expert_parallel": mode == "ep"}
                llm = LLM(model=str(path), max_model_len=512, **split)
                try:
                    for seqs in BATCHES:
                        took = step_seconds(llm, seqs, args.new_tokens, args.reps)
                        measured[mode, seqs] = min(measured.get((mode, seqs), took), took)
                finally:
                    llm.engine.shutdown()
        t = Table(title="decode step, ms: TP 2 (expert columns) against EP 2 (whole experts)")
        for col in ("sequences", "TP 2", "EP 2", "EP/TP measured", "EP/TP sizing model"):
            t.add_column(col, justify="right")
        ctx = PROMPT_LEN + args.new_tokens / 2
        for seqs in BATCHES:
            tp, ep = measured["tp", seqs], measured["ep", seqs]
            model = predicted_step(path, True, seqs, ctx) / predicted_step(path, False, seqs, ctx)
            t.add_row(str(seqs), f"{tp * 1e3:.1f}", f"{ep * 1e3:.1f}", f"{ep / tp:.2f}", f"{model:.2f}")
            res |= {
                f"tp_step_ms_{seqs}": tp * 1e3,
                f"ep_step_ms_{seqs}": ep * 1e3,
                f"ep_over_tp_{seqs}": ep / tp,
                f"ep_over_tp_model_{seqs}": model,
            }
        console.print(t)
    if args.quick:
        console.print("--quick: figures not recorded")
    else:
        record("moe_parallel", res, args=args)


if __name__ == "__main__":
    main()
