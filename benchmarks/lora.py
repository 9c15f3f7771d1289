"""Multi-LoRA throughput: 32 streams on the base model against the same 32 streams spread over 1, 4 and 16
adapters (rank 16, every linear of every layer adapted), in one engine and one run, interleaved; also
the memory one resident adapter takes and the time to read one into its slot.

- One `LLM(dtype="auto", enable_lora=True, max_loras=16, max_lora_rank=16)`: the base streams run in the
  engine that serves the adapters (the same kernels as without LoRA: a step with no row on an adapter
  skips every delta and keeps the C++ decode loop).
- Each round: 32 prompts of ~64 tokens, 64 greedy tokens each (ignore_eos), one `generate` call; stream i
  on adapter i mod k. Prompts are new every round (no prefix hit). Adapters are resident before timing
  (a warm round), so the figure is the step's cost, not the reads.
- Served: the same streams through `tokenmill serve --lora-modules a0=... a15=...` (its own process,
  the same engine settings), 32 concurrent /v1/completions requests, each naming its adapter as the
  model; tokens/s as the client counts them.
- Adapters are random PEFT-format directories written here (adapter_config.json + safetensors).

    python benchmarks/lora.py [--repeats 3] [--quick] [--no-served]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

import httpx
import torch
from safetensors.torch import save_file

sys.path.insert(0, str(Path(__file__).resolve().parent))
from machine import cpu_description  # noqa: E402
from results_log import add_flag, record  # noqa: E402
from served import serving  # noqa: E402

from tokenmill import LLM, LoRARequest, SamplingParams  # noqa: E402
from tokenmill.lora.adapter import module_shapes  # noqa: E402

WORDS = "the engine serves many fine tunes of one base model in the same batch of requests".split()  # noqa: SIM905


def write_adapter(where: Path, cfg, rank: int, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(cfg.num_layers):
        for name, (out, inp) in module_shapes(cfg).items():
            part = "mlp" if name in ("gate_proj", "up_proj", "down_proj") else "self_attn"
            key = f"base_model.model.model.layers.{layer}.{part}.{name}"
            tensors[f"{key}.lora_A.weight"] = torch.randn(rank, inp, generator=g) / inp**0.5
            tensors[f"{key}.lora_B.weight"] = torch.randn(out, rank, generator=g) * 0.01
    where.mkdir(parents=True)
    save_file(tensors, str(where / "adapter_model.safetensors"))
    config = {
        "peft_type": "LORA",
        "r": rank,
        "lora_alpha": 2 * rank,
        "target_modules": list(module_shapes(cfg)),
    }
    (where / "adapter_config.json").write_text(json.dumps(config))


def prompts(n: int, words: int, seed: int) -> list[str]:
    rng = random.Random(seed)
    return [" ".join(rng.choice(WORDS) for _ in range(words)) for _ in range(n)]


async def served_rate(base: str, model: str, names: list[str], texts: list[str], tokens: int) -> float:
    """Tokens/s of one request per text, all at once, request i naming names[i] (the base: `model`)."""
    async with httpx.AsyncClient(base_url=base, timeout=600) as client:

        async def one(name: str, text: str) -> int:
            body = {"model": name or model, "prompt": text, "max_tokens": tokens, "temperature": 0.0,
                    "ignore_eos": True}  # fmt: skip
            r = await client.post("/v1/completions", json=body)
            r.raise_for_status()
            return r.json()["usage"]["completion_tokens"]

        t0 = time.perf_counter()
        done = await asyncio.gather(*(one(n, t) for n, t in zip(names, texts, strict=True)))
        return sum(done) / (time.perf_counter() - t0)


def served_rates(args: argparse.Namespace, loras: list[LoRARequest], counts: tuple[int, ...]) -> dict:
    modules = [f"{x.lora_name}={x.lora_path}" for x in loras]
    serve_args = ["--max-model-len", "512", "--enable-lora", "--max-loras", "16", "--max-lora-rank", "16"]
    for m in modules:
        serve_args += ["--lora-modules", m]
    log = Path(tempfile.mkdtemp(prefix="lora-served-")) / "server.log"
    with serving(serve_args, log, lambda base, proc: True) as (base, _):
        model = httpx.get(f"{base}/v1/models").json()["data"][0]["id"]

        def run(k: int, seed: int) -> float:
            names = [loras[i % k].lora_name if k else "" for i in range(args.streams)]
            return asyncio.run(served_rate(base, model, names, prompts(args.streams, 48, seed), args.tokens))

        for k in counts:
            run(k, -11 - k)
        rates: dict[int, list[float]] = {k: [] for k in counts}
        for rep in range(args.repeats):
            for k in counts:
                rates[k].append(run(k, 1000 + 100 * rep + k))
    return {k: statistics.median(v) for k, v in rates.items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--streams", type=int, default=32)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--quick", action="store_true", help="a smoke test: 8 streams, one repeat, not recorded")
    ap.add_argument("--no-served", action="store_true", help="the offline figures only")
    add_flag(ap)
    args = ap.parse_args()
    if args.quick:
        args.streams, args.tokens, args.repeats, args.no_record = 8, 16, 1, True
    llm = LLM(dtype="auto", max_model_len=512, enable_lora=True, max_loras=16, max_lora_rank=16)
    cfg = llm.engine.model_config
    arithmetic = llm.engine.executor.worker.dtype  # type: ignore[attr-defined]
    print(f"{cpu_description()}; {args.streams} streams x {args.tokens} tokens; arithmetic {arithmetic}")
    tmp = Path(tempfile.mkdtemp(prefix="lora-bench-"))
    loras = []
    for i in range(16):
        write_adapter(tmp / f"a{i}", cfg, 16, i)
        loras.append(LoRARequest(f"a{i}", i + 1, str(tmp / f"a{i}")))
    params = SamplingParams(temperature=0.0, max_tokens=args.tokens, ignore_eos=True)
    counts = (0, 1, 4, 16)  # 0: the base model

    def run(k: int, texts: list[str]) -> float:
        reqs = [loras[i % k] if k else None for i in range(len(texts))]
        t0 = time.perf_counter()
        outs = llm.generate(texts, params, lora_request=reqs)
        dt = time.perf_counter() - t0
        return sum(len(o.outputs[0].token_ids) for o in outs) / dt

    for k in counts:  # warm: kernels, pages, and every adapter read into its slot
        run(k, prompts(args.streams, 48, seed=-1 - k))
    rates: dict[int, list[float]] = {k: [] for k in counts}
    for rep in range(args.repeats):
        for k in counts:
            rates[k].append(run(k, prompts(args.streams, 48, seed=100 * rep + k)))
    med = {k: statistics.median(v) for k, v in rates.items()}
    lora_model = llm.engine.runner.model.lora
    t0 = time.perf_counter()
    loads = 5
    for i in range(loads):
        lora_model.load(0, 1000 + i, loras[i].lora_path)
    load_ms = (time.perf_counter() - t0) / loads * 1000
    res = {
        "arithmetic": str(arithmetic).removeprefix("torch."),
        "streams": args.streams,
        "base_tok_s": round(med[0], 1),
        **{f"lora{k}_tok_s": round(med[k], 1) for k in counts[1:]},
        **{f"ratio_{k}": round(med[k] / med[0], 3) for k in counts[1:]},
        "adapter_mb": round(lora_model.memory_bytes / len(lora_model.slots) / 2**20, 2),
        "load_ms": round(load_ms, 1),
    }
    llm.close()  # its memory and threads are the server's now
    if not args.no_served:
        srv = served_rates(args, loras, counts)
        res.update({"served_base_tok_s": round(srv[0], 1)})
        res.update({f"served_lora{k}_tok_s": round(srv[k], 1) for k in counts[1:]})
        res.update({f"served_ratio_{k}": round(srv[k] / srv[0], 3) for k in counts[1:]})
    for key, v in res.items():
        print(f"{key:20s} {v}")
    record("lora", res, args=args)


if __name__ == "__main__":
    main()
