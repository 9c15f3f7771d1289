"""A bigger model for the peers comparison: a real shape of the SmolLM2 family with seeded random
weights, as a GGUF (tokenmill and llama.cpp read it) and optionally as a bf16 Hugging Face directory
(vLLM reads that; made by export_hf.py from the bf16 file, so all three hold the same values).

    .venv/bin/python benchmarks/peers/make_synthetic.py --shape smollm2-1.7b --types bf16,q8_0,q4_0 --hf

Prints each file's path; an existing file is left alone. No model above 135M parameters can be
installed here (no hub), so speed and memory at 0.36-1.7B are measured on these
(tokenmill/weights/synthetic.py says why random values measure speed honestly). The files go to
$PEERS_DIR/synthetic/ (default ~/.cache/tokenmill-peers/synthetic/).
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent


def main() -> None:
    from tokenmill.weights import catalog, synthetic

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", default="smollm2-1.7b", choices=sorted(synthetic.SHAPES))
    ap.add_argument("--types", default="bf16", help=f"comma-separated, of {', '.join(synthetic.TYPES)}")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument(
        "--head-type",
        help="the embedding and head's type (llama.cpp's quantizer keeps them wider: q8_0 stands in for"
        " its Q6_K); default: as the other matrices",
    )
    ap.add_argument("--hf", action="store_true", help="also a bf16 Hugging Face directory for vLLM")
    ap.add_argument("--peers-dir", default=os.environ.get("PEERS_DIR", "~/.cache/tokenmill-peers"))
    args = ap.parse_args()

    shape = synthetic.SHAPES[args.shape]
    types = [t.strip() for t in args.types.split(",") if t.strip()]
    bad = [t for t in [*types, args.head_type or "bf16"] if t not in synthetic.TYPES]
    if bad:
        sys.exit(f"error: unknown type {bad[0]!r}; choose from {', '.join(synthetic.TYPES)}")
    if args.hf and "bf16" not in types:
        types.insert(0, "bf16")
    peers = Path(args.peers_dir).expanduser()
    src = catalog.resolve(catalog.DEFAULT_MODEL)
    vocab = 49152
    print(f"{shape.name}: {shape.parameters(vocab) / 1e9:.2f}B parameters, random (seed {args.seed})")
    paths = {}
    for t in types:
        head = None if t == "bf16" else args.head_type  # vLLM's bf16 file stays whole
        dst = synthetic.default_path(shape, t, args.seed, peers, head)
        if not dst.exists():
            t0 = time.perf_counter()
            synthetic.synthesize(src, dst, shape, t, args.seed, head_type=head)
            print(f"  wrote {dst} ({dst.stat().st_size / 1e9:.2f} GB) in {time.perf_counter() - t0:.0f} s")
        paths[t] = dst
        print(f"{t}: {dst}")
    if args.hf:
        hf_dir = paths["bf16"].with_name(f"{shape.name}-random{args.seed}-hf")
        subprocess.run(
            [sys.executable, str(HERE / "export_hf.py"), "--gguf", str(paths["bf16"]), "--out", str(hf_dir)],
            check=True,
        )
        print(f"hf: {hf_dir}")


if __name__ == "__main__":
    main()
