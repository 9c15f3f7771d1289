"""Run in a subprocess by test_isa_paths.py, under ONEDNN_MAX_CPU_ISA / ATEN_CPU_CAPABILITY limits:
the PyTorch and oneDNN code paths another CPU would take, measured against float64 references.

    python tests/isa_paths.py [--engine LEVEL]

Prints one JSON object of relative errors (and, with --engine, teacher-forced fidelity figures of
the engine with the C++ kernels at LEVEL and with the plain-PyTorch ops, both against float32).
"""

from __future__ import annotations

import argparse
import json
import os

import torch
import torch.nn.functional as F
from torch import nn


def rel(got: torch.Tensor, exact: torch.Tensor) -> float:
    return float((got.double() - exact).norm() / exact.norm())


@torch.inference_mode()
def linear_errors() -> dict[str, float]:
    from tokenmill.models.linear import QuantizedLinear, pack_linears

    torch.manual_seed(0)
    out: dict[str, float] = {}
    model = nn.Sequential(nn.Linear(1536, 576, bias=False)).to(torch.bfloat16)
    w = model[0].weight.detach().double()
    out["packed"] = float(pack_linears(model))  # 1 if oneDNN packing works at this ISA, else 0
    for rows in (1, 64):
        x = torch.randn(rows, 1536).to(torch.bfloat16)
        out[f"linear_rows{rows}"] = rel(model(x), x.double() @ w.t())
    for bits in (4, 8):
        lin = nn.Linear(1536, 576, bias=False).to(torch.bfloat16)
        q = QuantizedLinear(lin, bits=bits, max_rows=4)
        x = torch.randn(2, 1536).to(torch.bfloat16)
        # Against its own dequantized weights: the kernel's arithmetic, not the quantization error.
        wq = q.wide.weight if hasattr(q.wide, "weight") else None
        if wq is None:  # packed twin: recover the dequantized weight through an identity input
            wq = q.wide(torch.eye(1536, dtype=torch.bfloat16)).t()
        out[f"int{bits}_rows2"] = rel(q(x), x.double() @ wq.double().t())
    return out


def attention_error() -> float:
    g = torch.Generator().manual_seed(0)
    q = torch.randn(1, 9, 300, 64, generator=g).to(torch.bfloat16)
    k = torch.randn(1, 9, 300, 64, generator=g).to(torch.bfloat16)
    v = torch.randn(1, 9, 300, 64, generator=g).to(torch.bfloat16)
    got = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    s = (q.double() @ k.double().transpose(-1, -2)) / 8
    s = s.masked_fill(torch.ones(300, 300, dtype=torch.bool).triu(1), float("-inf"))
    return rel(got, s.softmax(-1) @ v.double())


def engine_fidelity(level: str) -> dict[str, dict[str, float]]:
    from tokenmill import LLM
    from tokenmill.quality.fidelity import compare, forced_run
    from tokenmill.quality.prompts import chat_prompts

    common = {"max_model_len": 512, "kv_cache_memory_gb": 0.1, "enable_prefix_caching": False}
    ref_llm = LLM(dtype="float32", kernels="torch", **common)
    prompts = chat_prompts(ref_llm.tokenizer)
    ref = forced_run(ref_llm, prompts, 24)
    del ref_llm
    result = {}
    for name in ("torch", level):
        llm = LLM(dtype="bfloat16", kernels=name, **common)
        f = compare(ref, forced_run(llm, prompts, 24, ref), forced_run(llm, prompts, 24))
        result[name] = {"top1": f.top1_agreement, "mean_kl": f.mean_kl, "prefix": f.greedy_prefix_tokens}
        del llm
    return result


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--engine", help="also measure the engine with the C++ kernels at this ISA level")
    args = ap.parse_args()
    report: dict[str, object] = {
        "onednn_max_isa": os.environ.get("ONEDNN_MAX_CPU_ISA", ""),
        "aten_capability": torch.backends.cpu.get_cpu_capability(),
        **linear_errors(),
        "sdpa": attention_error(),
    }
    if args.engine:
        report["engine"] = engine_fidelity(args.engine)
    print(json.dumps(report))


if __name__ == "__main__":
    main()
