"""What structured output costs in decode throughput: N streams constrained by a JSON schema (or a regex)
against the same N streams unconstrained, on one engine, batches alternating so that both see the same
machine. Every constrained output is held to exactly --max-tokens tokens (the schema: an array with
more items than fit; the regex: unbounded, with min_tokens), the unconstrained ones by ignore_eos, so
both decode the same number of steps and the ratio is the cost of filling, applying and advancing the
grammar masks.

    python benchmarks/structured_throughput.py [--streams 32] [--max-tokens 128] [--repeats 3]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

from tokenmill import LLM
from tokenmill.sampling_params import SamplingParams, StructuredOutputs

PROMPTS = [
    "List the prime numbers you know as a JSON array.",
    "Give me a JSON array of the years of the twentieth century.",
    "Write the squares of the numbers from 1 to 100 as a JSON array.",
    "Output a JSON array of random integers.",
]
# More items than max_tokens can hold: the grammar never lets the array close early.
LONG_ARRAY = {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 99999}, "minItems": 400}
LONG_OBJECT = {
    "type": "object",
    "properties": {
        "title": {"type": "string", "maxLength": 40},
        "values": LONG_ARRAY,
    },
    "required": ["title", "values"],
    "additionalProperties": False,
}
CASES = {
    "json_schema": StructuredOutputs(json=json.dumps(LONG_OBJECT)),
    # Unbounded, so it never ends the text itself (min_tokens holds EOS back). A large counted
    # repetition such as [a-z ]{2000} would cost ~300 us per token and stream in llguidance's lexer
    # (10 ms a step at 32 streams), against ~10 us for this one.
    "regex": StructuredOutputs(regex="[a-z ]+"),
}


def rate(llm: LLM, streams: int, params: SamplingParams) -> float:
    batch = [[{"role": "user", "content": PROMPTS[i % len(PROMPTS)]}] for i in range(streams)]
    t0 = time.perf_counter()
    outs = llm.chat(batch, params)
    elapsed = time.perf_counter() - t0
    lengths = [len(o.outputs[0].token_ids) for o in outs]
    if min(lengths) != params.max_tokens:
        raise SystemExit(f"an output ended early ({min(lengths)} tokens): the comparison would not be fair")
    return sum(lengths) / elapsed


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--streams", type=int, default=32)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--dtype", default="bfloat16")
    args = ap.parse_args()
    llm = LLM(dtype=args.dtype, max_model_len=1024, max_num_seqs=max(args.streams, 1))
    plain = SamplingParams(temperature=0, max_tokens=args.max_tokens, ignore_eos=True)
    constrained = {
        name: SamplingParams(
            temperature=0,
            max_tokens=args.max_tokens,
            min_tokens=args.max_tokens if spec.regex else 0,  # the schema needs no help
            structured=spec,
        )
        for name, spec in CASES.items()
    }
    try:
        for p in (plain, *constrained.values()):  # warm-up: compiles the grammars, fills the caches
            rate(llm, 2, p)
        rates: dict[str, list[float]] = {"plain": [], **{name: [] for name in constrained}}
        for _ in range(args.repeats):  # alternating, so slow spells of the machine hit every case
            rates["plain"].append(rate(llm, args.streams, plain))
            for name, p in constrained.items():
                rates[name].append(rate(llm, args.streams, p))
    finally:
        llm.close()
    base = statistics.median(rates["plain"])
    print(f"{args.streams} streams x {args.max_tokens} tokens, {args.dtype}, median of {args.repeats}")
    print(f"{'case':<12} {'tok/s':>8} {'vs plain':>9}")
    for name, values in rates.items():
        r = statistics.median(values)
        print(f"{name:<12} {r:8.1f} {r / base:8.3f}x")


if __name__ == "__main__":
    main()
