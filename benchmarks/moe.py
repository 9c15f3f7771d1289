"""Mixtures of experts: a synthetic Mixtral's offline generation against Hugging Face `generate`, and the
fused MoE layer against a per-expert loop of Hugging Face's eager kind, each against its baseline in the
same run (absolute times on a shared 2-core machine drift from run to run, ratios much less).

1. Generation: a random Mixtral of a realistic shape (8 experts, top-2, hidden 1024, experts' intermediate
   2816, 16 query / 4 key-value heads; 4 layers by default, to keep a run to a few minutes), saved as a
   bf16 Hugging Face directory with the SmolLM2 tokenizer. tokenmill's `LLM.generate` (dtype "auto", the
   engine's default) and HF `generate` (in the arithmetic tokenmill picked, as offline_throughput.py
   does) run the same prompts to the same number of new tokens; HF batched and left-padded as in
   offline_throughput.py. Reported: output tokens/s of each (prefill included) and their ratio.
2. Layer: models/moe.py's FusedMoE built at that shape with random weights, against a plain loop over the
   experts (a torch.where mask of each expert's tokens, its MLP on those rows, an index_add_ of the
   weighted output) and against HF's MixtralSparseMoeBlock in its default experts implementation, on the
   same weights, at several token counts: median ms per call, interleaved, and the outputs compared.

    python benchmarks/moe.py [--layers 4] [--prompts 16] [--new-tokens 64] [--rows 1,8,64,512] [--quick]

`--quick`: a tiny shape and workload, a smoke test of the script (its figures are not recorded).
"""

from __future__ import annotations

import argparse
import functools
import random
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
import transformers
from rich.console import Console
from rich.table import Table

sys.path.insert(0, str(Path(__file__).resolve().parent))
from machine import ForeignLoad, cpu_description  # noqa: E402
from results_log import Metric, add_flag, record  # noqa: E402

from tokenmill import LLM, SamplingParams  # noqa: E402
from tokenmill.models.config import ModelConfig  # noqa: E402
from tokenmill.models.linear import pack_linears  # noqa: E402
from tokenmill.models.moe import FusedMoE  # noqa: E402
from tokenmill.models.ops import TorchOps, get_ops  # noqa: E402
from tokenmill.models.parallel import NoCollectives, Shard  # noqa: E402

VOCAB = 49152  # the SmolLM2 tokenizer saved beside the weights: the model's vocabulary must match it
PAD_ID = 2  # any id: HF masks the padding out (offline_throughput.py pads with the same)

# --quick's sizes: every code path of the full run, small enough for well under a minute.
QUICK = {
    "layers": 2,
    "hidden": 256,
    "expert_intermediate": 704,
    "heads": 4,
    "kv_heads": 2,
    "prompts": 4,
    "prompt_len": 32,
    "new_tokens": 16,
    "hf_batch_size": 4,
    "reps": 5,
}

# Largest difference between the fused layer's output and the loop's, over the loop's largest value.
# float32: the same matmuls on the same rows, summed in the same order: rounding only. bf16: the
# weighting and the sums round to 8 bits of mantissa.
TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 2e-2}


def hf_config(
    args: argparse.Namespace, experts_implementation: str | None = None
) -> transformers.MixtralConfig:
    """The one description of the shape: the random model is made from it, FusedMoE's ModelConfig is read
    from it, and HF's block is built from it."""
    return transformers.MixtralConfig(
        vocab_size=VOCAB,
        hidden_size=args.hidden,
        intermediate_size=args.expert_intermediate,  # Mixtral's intermediate_size is its experts'
        num_hidden_layers=args.layers,
        num_attention_heads=args.heads,
        num_key_value_heads=args.kv_heads,
        num_local_experts=args.experts,
        num_experts_per_tok=args.top_k,
        max_position_embeddings=4096,
        tie_word_embeddings=False,
        experts_implementation=experts_implementation,
    )


def shape_text(args: argparse.Namespace) -> str:
    return (
        f"{args.layers} layers, hidden {args.hidden}, {args.experts} experts top-{args.top_k} of "
        f"intermediate {args.expert_intermediate}, {args.heads}/{args.kv_heads} heads"
    )


# --- 1. generation --------------------------------------------------------------------------------


def make_model(cfg: transformers.MixtralConfig, path: Path, seed: int) -> float:
    """A random Mixtral saved in bf16 with the SmolLM2 tokenizer; its parameter count (billions)."""
    from tokenmill.tokenizer.tokenizer import Tokenizer
    from tokenmill.weights import catalog
    from tokenmill.weights.gguf_file import GGUFFile

    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    params = sum(p.numel() for p in model.parameters()) / 1e9
    # bf16 on disk, as released checkpoints are: dtype "auto" keeps bf16 weights, so both sides read
    # the same values whichever arithmetic they compute in.
    model.to(torch.bfloat16).save_pretrained(path)
    del model
    Tokenizer.from_gguf_metadata(GGUFFile(catalog.resolve("smollm2-135m")).metadata).save(path)
    return params


def workload(n: int, prompt_len: int, seed: int) -> list[list[int]]:
    """n prompts of prompt_len/2 to prompt_len random ids: varied lengths, so HF's batches carry the
    left padding a real batch does."""
    rng = random.Random(seed)
    return [
        [rng.randrange(100, VOCAB) for _ in range(rng.randint(prompt_len // 2, prompt_len))] for _ in range(n)
    ]


def run_tokenmill(llm: LLM, prompts: list[list[int]], new: int) -> tuple[float, list[list[int]]]:
    sp = SamplingParams(temperature=0, max_tokens=new, ignore_eos=True)
    t0 = time.perf_counter()
    outs = llm.generate(prompts, sp, use_tqdm=False)
    return time.perf_counter() - t0, [list(o.outputs[0].token_ids) for o in outs]


@torch.inference_mode()
def run_hf(
    model: transformers.PreTrainedModel, prompts: list[list[int]], new: int, batch_size: int
) -> tuple[float, list[list[int]]]:
    """HF generate batched as offline_throughput.py batches it: sorted by length (least padding),
    left-padded, min_new_tokens = max_new_tokens (every prompt asks the same count, so none is wasted).
    The generated ids come back in prompt order."""
    order = sorted(range(len(prompts)), key=lambda i: len(prompts[i]))
    outs: list[list[int]] = [[] for _ in prompts]
    t0 = time.perf_counter()
    for b in range(0, len(order), batch_size):
        batch = order[b : b + batch_size]
        width = max(len(prompts[i]) for i in batch)
        ids = torch.full((len(batch), width), PAD_ID, dtype=torch.long)
        mask = torch.zeros((len(batch), width), dtype=torch.long)
        for r, i in enumerate(batch):
            ids[r, width - len(prompts[i]) :] = torch.tensor(prompts[i])
            mask[r, width - len(prompts[i]) :] = 1
        gen = model.generate(
            input_ids=ids,
            attention_mask=mask,
            max_new_tokens=new,
            min_new_tokens=new,
            do_sample=False,
            pad_token_id=PAD_ID,
        )
        for r, i in enumerate(batch):
            outs[i] = gen[r, width:].tolist()
    return time.perf_counter() - t0, outs


def generation(args: argparse.Namespace, console: Console) -> dict[str, Metric]:
    res: dict[str, Metric] = {}
    threads = torch.get_num_threads()
    prompts = workload(args.prompts, args.prompt_len, args.seed)
    warm = workload(2, args.prompt_len, args.seed + 1)
    with tempfile.TemporaryDirectory(prefix="tokenmill-moe-") as tmp:
        path = Path(tmp)
        t0 = time.perf_counter()
        params = make_model(hf_config(args), path, args.seed)
        console.print(f"random Mixtral, {params:.2f}B parameters, made in {time.perf_counter() - t0:.0f} s")
        res["parameters_b"] = params

        llm = LLM(model=str(path), dtype=args.dtype, max_model_len=args.prompt_len + args.new_tokens + 16)
        worker = llm.engine.executor.worker  # type: ignore[attr-defined]
        # HF computes in the arithmetic tokenmill picked ("auto": bf16 where the CPU has BF16
        # instructions, else float32), so that both sides compute alike.
        arithmetic: torch.dtype = worker.dtype
        res["arithmetic"] = str(arithmetic).removeprefix("torch.")
        # Warm-up on both sides: one-time costs (weight packing, kernels' first calls, allocator) are not
        # what a steady run pays.
        run_tokenmill(llm, warm, 4)
        with ForeignLoad() as load:
            dt, tm_out = run_tokenmill(llm, prompts, args.new_tokens)
        res["foreign_load_tokenmill"] = load.share
        tm_tok_s = args.prompts * args.new_tokens / dt
        res["tokenmill_seconds"], res["tokenmill_output_tok_s"] = dt, tm_tok_s
        # The thread governor sheds threads while a neighbour crowds the cores (HF's side has no such
        # thing): a change explains a ratio, so the figures say how many and where it ended.
        res["tokenmill_threads_at_end"], res["tokenmill_thread_changes"] = worker.compute_threads()
        llm.close()  # the engine's loop stopped: nothing of it runs beside HF's turn
        del llm, worker

        if not args.skip_hf:
            torch.set_num_threads(threads)  # the governor may have left this process fewer
            model = transformers.AutoModelForCausalLM.from_pretrained(str(path), dtype=arithmetic).eval()
            res["hf_experts_implementation"] = str(getattr(model.config, "_experts_implementation", None))
            batches = -(-args.prompts // args.hf_batch_size)
            res["hf_batching"] = (
                f"{batches} batch(es) of up to {args.hf_batch_size}, sorted by length, left-padded"
            )
            run_hf(model, warm, 4, args.hf_batch_size)
            with ForeignLoad() as load:
                dt, hf_out = run_hf(model, prompts, args.new_tokens, args.hf_batch_size)
            res["foreign_load_hf"] = load.share
            hf_tok_s = args.prompts * args.new_tokens / dt
            res["hf_seconds"], res["hf_output_tok_s"] = dt, hf_tok_s
            res["throughput_ratio"] = tm_tok_s / hf_tok_s
            # A check that both ran the same model (a misnamed expert would still be timed): greedy
            # decoding agrees, bar near-ties that bf16 rounding flips late in a sequence.
            pairs = list(zip(tm_out, hf_out, strict=True))
            res["same_first_token"] = f"{sum(a[:1] == b[:1] for a, b in pairs)}/{len(pairs)}"
            res["same_output"] = f"{sum(a == b for a, b in pairs)}/{len(pairs)}"
            del model
    return res


def generation_table(args: argparse.Namespace, res: dict[str, Metric]) -> Table:
    hf_ran = "hf_output_tok_s" in res
    t = Table(
        title=f"Offline generation: {args.prompts} prompts of {args.prompt_len // 2}-{args.prompt_len} "
        f"tokens, {args.new_tokens} new tokens each, greedy, {res['arithmetic']} arithmetic",
        caption=f"HF: {res['hf_experts_implementation']} experts; {res['hf_batching']}" if hf_ran else None,
    )
    t.add_column("")
    for col in ("seconds", "output tok/s", "tokenmill over HF"):
        t.add_column(col, justify="right")
    tok_s = float(res["tokenmill_output_tok_s"] or 0)
    t.add_row("tokenmill LLM.generate", f"{res['tokenmill_seconds']:.2f}", f"{tok_s:.1f}", "")
    if hf_ran:
        hf = float(res["hf_output_tok_s"] or 0)
        t.add_row("HF generate", f"{res['hf_seconds']:.2f}", f"{hf:.1f}", f"{tok_s / hf:.2f}x")
    return t


# --- 2. the layer -----------------------------------------------------------------------------------


@dataclass(frozen=True)
class MoeWeights:
    router: torch.Tensor  # [experts, hidden]
    gate_up: torch.Tensor  # [experts, 2 * intermediate, hidden]: gate rows, then up rows
    down: torch.Tensor  # [experts, hidden, intermediate]


def random_weights(cfg: ModelConfig, seed: int, dtype: torch.dtype) -> MoeWeights:
    """Scaled so each matmul keeps unit-sized values (a relative tolerance then means something) and the
    router's logits are far enough apart that top-k has no near-ties to break differently."""
    g = torch.Generator().manual_seed(seed)
    e, h, i = cfg.num_experts, cfg.hidden_size, cfg.expert_intermediate_size
    return MoeWeights(
        (torch.randn(e, h, generator=g) * h**-0.5).to(dtype),
        (torch.randn(e, 2 * i, h, generator=g) * h**-0.5).to(dtype),
        (torch.randn(e, h, i, generator=g) * i**-0.5).to(dtype),
    )


def fused_layer(cfg: ModelConfig, w: MoeWeights, ops: TorchOps) -> FusedMoE:
    """The layer as the engine builds it: its experts' linears packed for this CPU's kernels (oneDNN's
    packed copy, the panel kernels), as quantize_model packs a model's plain linears."""
    layer = FusedMoE(cfg, Shard.whole(cfg), NoCollectives())
    sd = {"router.weight": w.router}
    for e in range(cfg.num_experts):
        sd[f"experts.{e}.gate_up_proj.weight"] = w.gate_up[e]
        sd[f"experts.{e}.down_proj.weight"] = w.down[e]
    layer.load_state_dict(sd, strict=True, assign=True)
    pack_linears(layer, ops.small_matmul_for, ops.panels_take_every_row())
    layer.finalize()
    return layer.eval()


def expert_loop(x: torch.Tensor, w: MoeWeights, top_k: int) -> torch.Tensor:
    """The baseline: Hugging Face's eager loop, written plainly. Each expert finds its tokens with a mask
    and torch.where, gathers them, runs its MLP and index_add_s the weighted result."""
    probs = torch.softmax(F.linear(x, w.router), dim=-1, dtype=torch.float32)
    weights, ids = probs.topk(top_k, dim=-1)
    weights = (weights / weights.sum(dim=-1, keepdim=True)).to(x.dtype)
    hit = F.one_hot(ids, num_classes=w.router.shape[0]).permute(2, 1, 0)  # [expert, slot, token]
    out = torch.zeros_like(x)
    for e in range(w.router.shape[0]):
        slot, token = torch.where(hit[e])
        if token.numel() == 0:
            continue
        gate, up = F.linear(x[token], w.gate_up[e]).chunk(2, dim=-1)
        y = F.linear(F.silu(gate) * up, w.down[e]) * weights[token, slot, None]
        out.index_add_(0, token, y)
    return out


def hf_block(args: argparse.Namespace, w: MoeWeights, implementation: str) -> torch.nn.Module:
    """HF's own Mixtral block in the experts implementation its generate ran (its default otherwise): the
    layer the generation baseline actually runs."""
    from transformers.models.mixtral.modeling_mixtral import MixtralSparseMoeBlock

    block = MixtralSparseMoeBlock(hf_config(args, experts_implementation=implementation))
    sd = {"gate.weight": w.router, "experts.gate_up_proj": w.gate_up, "experts.down_proj": w.down}
    block.load_state_dict(sd, strict=True, assign=True)
    return block.eval()


def time_interleaved(fns: dict[str, Callable[[], object]], warmup: int, reps: int) -> dict[str, float]:
    """Median ms per call of each function. The functions take turns within each repetition, so that a
    neighbour's load or a clock change falls on all of them alike rather than on whichever ran then; the
    turn's order rotates, so that none always runs first after another's cache traffic."""
    for _ in range(warmup):
        for f in fns.values():
            f()
    names = list(fns)
    times: dict[str, list[float]] = {name: [] for name in fns}
    for rep in range(reps):
        for name in names[rep % len(names) :] + names[: rep % len(names)]:
            t0 = time.perf_counter()
            fns[name]()
            times[name].append((time.perf_counter() - t0) * 1e3)
    return {name: statistics.median(ts) for name, ts in times.items()}


@torch.inference_mode()
def layer_bench(args: argparse.Namespace, hf_implementation: str) -> list[dict[str, float]]:
    cfg = ModelConfig.from_hf(hf_config(args).to_dict())
    dtype = getattr(torch, args.layer_dtype)
    w = random_weights(cfg, args.seed, dtype)
    # The engine's ops on a CPU (the fused C++ silu_mul where the kernels build), else PyTorch's.
    ops: TorchOps = get_ops("auto", "cpu")
    fused = fused_layer(cfg, w, ops)
    block = hf_block(args, w, hf_implementation)
    g = torch.Generator().manual_seed(args.seed + 1)
    rows_out = []
    for rows in (int(r) for r in args.rows.split(",")):
        x = torch.randn(rows, cfg.hidden_size, generator=g).to(dtype)
        ref = expert_loop(x, w, cfg.experts_per_token)
        scale = ref.abs().max().item()
        err = (fused(x, ops) - ref).abs().max().item() / scale
        hf_err = (block(x.unsqueeze(0))[0] - ref).abs().max().item() / scale
        calls: dict[str, Callable[[], object]] = {
            "fused": functools.partial(fused, x, ops),
            "loop": functools.partial(expert_loop, x, w, cfg.experts_per_token),
            "hf": functools.partial(block, x.unsqueeze(0)),
        }
        ms = time_interleaved(calls, warmup=2, reps=args.reps)
        rows_out.append({"rows": rows, "err": err, "hf_err": hf_err, **ms})
    return rows_out


def layer_table(args: argparse.Namespace, rows: list[dict[str, float]], hf_impl: str, tol: float) -> Table:
    t = Table(
        title=f"FusedMoE layer, {args.layer_dtype}: ms per call, median of {args.reps} (interleaved)",
        caption=f"loop: a torch.where mask per expert, as HF's eager experts; HF: its MixtralSparseMoeBlock "
        f"({hf_impl} experts). error: max |fused - loop| / max |loop| (tolerance {tol:g}), and HF's",
    )
    for col in ("rows", "fused ms", "loop ms", "HF ms", "speed-up vs loop", "vs HF", "error", "HF error"):
        t.add_column(col, justify="right")
    for r in rows:
        err = f"{r['err']:.1e}" if r["err"] <= tol else f"[red]{r['err']:.1e}[/red]"
        t.add_row(
            str(int(r["rows"])),
            f"{r['fused']:.2f}",
            f"{r['loop']:.2f}",
            f"{r['hf']:.2f}",
            f"{r['loop'] / r['fused']:.2f}x",
            f"{r['hf'] / r['fused']:.2f}x",
            err,
            f"{r['hf_err']:.1e}",
        )
    return t


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="a tiny shape and workload, not recorded")
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--expert-intermediate", type=int, default=2816, help="each expert's intermediate size")
    ap.add_argument("--experts", type=int, default=8)
    ap.add_argument("--top-k", type=int, default=2)
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--kv-heads", type=int, default=4)
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--prompt-len", type=int, default=128, help="prompts are half this to this many tokens")
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--hf-batch-size", type=int, default=16)
    ap.add_argument("--dtype", default="auto", help="tokenmill's; HF computes in the arithmetic it picks")
    ap.add_argument("--rows", default="1,8,64,512", help="the layer's token counts")
    ap.add_argument("--reps", type=int, default=7, help="timed calls of the layer per row count")
    ap.add_argument("--layer-dtype", default="bfloat16", choices=["float32", "bfloat16"])
    ap.add_argument("--skip-hf", action="store_true", help="no HF generate (the layer's baselines still run)")
    ap.add_argument("--skip-generation", action="store_true")
    ap.add_argument("--skip-layer", action="store_true")
    ap.add_argument("--seed", type=int, default=0)
    add_flag(ap)
    # --quick changes the defaults, not what is given on the command line.
    if ap.parse_known_args()[0].quick:
        ap.set_defaults(**QUICK)
    args = ap.parse_args()

    # 120 columns when piped (a log), so that the tables do not wrap at rich's default of 80.
    console = Console(width=None if sys.stdout.isatty() else 120)
    console.print(f"CPU: {cpu_description()}; torch threads {torch.get_num_threads()}")
    console.print(f"shape: {shape_text(args)}")
    res: dict[str, Metric] = {"threads": torch.get_num_threads(), "shape": shape_text(args)}
    hf_impl = "grouped_mm"  # HF's default experts implementation, where generate did not say otherwise
    if not args.skip_generation:
        res |= {"prompts": args.prompts, "prompt_len": args.prompt_len, "new_tokens": args.new_tokens}
        gen = generation(args, console)
        res |= gen
        hf_impl = str(gen.get("hf_experts_implementation", hf_impl))
        console.print(generation_table(args, gen))
        if "same_output" in gen:
            console.print(
                f"greedy tokens the same as HF's: first token {gen['same_first_token']}, "
                f"whole output {gen['same_output']}"
            )
        console.print(
            f"tokenmill's thread governor: {gen['tokenmill_thread_changes']} change(s), "
            f"{gen['tokenmill_threads_at_end']} thread(s) at the end, of {res['threads']} (HF's)"
        )
        runs = {"tokenmill": "tokenmill's run", "hf": "HF's run"}
        others = [
            f"{float(gen[f'foreign_load_{k}'] or 0):.0%} during {run}"
            for k, run in runs.items()
            if f"foreign_load_{k}" in gen
        ]
        console.print(f"other processes' share of the cores: {', '.join(others)}")

    ok = True
    if not args.skip_layer:
        tol = TOLERANCE[getattr(torch, args.layer_dtype)]
        with ForeignLoad() as load:
            rows = layer_bench(args, hf_impl)
        res["foreign_load_layer"] = load.share
        console.print(layer_table(args, rows, hf_impl, tol))
        worst = max(r["err"] for r in rows)
        ok = worst <= tol
        res |= {"layer_dtype": args.layer_dtype, "layer_max_rel_err": worst, "layer_hf_impl": hf_impl}
        res["layer_hf_max_rel_err"] = max(r["hf_err"] for r in rows)
        for r in rows:
            n = int(r["rows"])
            res[f"layer_fused_ms_{n}"] = r["fused"]
            res[f"layer_loop_ms_{n}"] = r["loop"]
            res[f"layer_hf_ms_{n}"] = r["hf"]
            res[f"layer_speedup_over_loop_{n}"] = r["loop"] / r["fused"]
            res[f"layer_speedup_over_hf_{n}"] = r["hf"] / r["fused"]
        res["layer_speedup_over_loop_worst"] = min(r["loop"] / r["fused"] for r in rows)
        console.print(f"other processes' share of the cores: {load.share:.0%} during the layer's timing")
        if not ok:
            console.print(f"[red]the fused layer differs from the loop by {worst:.1e} (> {tol:g})[/red]")

    if args.quick:
        console.print("--quick: figures not recorded")
    elif ok:
        record("moe", res, args=args)
    if not ok:
        sys.exit(1)


if __name__ == "__main__":
    main()
