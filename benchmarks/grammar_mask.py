"""What a grammar costs per token: llguidance against xgrammar on the embedded model's real tokenizer.

For each case (JSON schemas of several shapes, any JSON object, a regex, a choice) and each engine:

* compile, cold: from the spec to a matcher ready for its first mask, with nothing cached;
* first walk: a cold compile and then the whole text (llguidance builds its lexer lazily, during the
  first masks; xgrammar while compiling), so the cold costs compare fairly;
* cached: a new matcher for a spec compiled before (what a repeated schema costs);
* per token: filling the next-token bitmask and accepting the token, along the tokenization of a valid
  text followed by EOS (median and 95th percentile over every position of several warm walks), for
  each library and for tokenmill.structured itself (llguidance plus its bookkeeping).

Then which engine refuses, enforces or silently lets through schemas with keywords that are hard to
enforce, and `apply_bitmask` on (32, 49152) float32 logits. Everything runs on one thread (torch and
both engines): per-core figures. Both engines get tokenmill's JSON layout (", " and ": ", no other
whitespace) so that one token sequence is valid for both.

Measured on an AMD EPYC (2 cores), llguidance 1.9.1, xgrammar 0.2.8: xgrammar fills masks ~4x faster
per token (median 2.2 us against 9.5 us for JSON; 2 against 22 us for a choice), compiles JSON schemas
cold in ~5 ms against ~0.4 ms (first walk included: 5.5 against 1.8 ms), and lets texts through that
break `not`, `contains`, `if`/`then`, `uniqueItems` or an unknown `format`, where llguidance refuses
the schema. tokenmill uses llguidance: enforcing the schema it accepted matters more than ~8 us per
token (32 constrained streams: ~0.3 ms of a ~43 ms decode step here, docs/history/benchmarks.md).
apply_bitmask at the time: ~1.6 ms for all 32 rows (xgrammar's compiled CPU kernel: ~3.3 ms); since
replaced by a byte-table lookup into kept buffers (~0.5 ms on 2 threads; structured_throughput.py).

xgrammar (and transformers, for its tokenizer) is not a dependency of tokenmill: install it to rerun.

    .venv/bin/pip install xgrammar
    .venv/bin/python benchmarks/grammar_mask.py [--walks 5] [--cold 5] [--cached 50]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from tokenmill.sampling_params import StructuredOutputs
from tokenmill.structured import GrammarBackend, allocate_bitmask, apply_bitmask
from tokenmill.structured.grammar_source import JSON_LAYOUT
from tokenmill.tokenizer.tokenizer import Tokenizer
from tokenmill.weights.catalog import resolve
from tokenmill.weights.tokenizer_source import load_tokenizer


@dataclass
class Case:
    name: str
    kind: str  # "json", "regex" or "choice"
    spec: Any  # a schema dict, a regex, or a list of strings
    instance: str  # a valid output, tokenized to walk the matchers


ADDRESS = {
    "type": "object",
    "properties": {
        "street": {"type": "string"},
        "city": {"type": "string"},
        "zip": {"type": "string", "pattern": "^[0-9]{5}$"},
    },
    "required": ["street", "city", "zip"],
    "additionalProperties": False,
}

CASES = [
    Case(
        "nested object",
        "json",
        {
            "type": "object",
            "properties": {
                "name": {"type": "string"},
                "age": {"type": "integer", "minimum": 0, "maximum": 150},
                "address": ADDRESS,
            },
            "required": ["name", "age", "address"],
            "additionalProperties": False,
        },
        {
            "name": "Ada Lovelace",
            "age": 36,
            "address": {"street": "1 St James's Sq", "city": "London", "zip": "12345"},
        },
    ),
    Case(
        "array of objects",
        "json",
        {
            "type": "object",
            "properties": {
                "items": {
                    "type": "array",
                    "minItems": 1,
                    "maxItems": 4,
                    "items": {
                        "type": "object",
                        "properties": {"sku": {"type": "string"}, "qty": {"type": "integer", "minimum": 1}},
                        "required": ["sku", "qty"],
                        "additionalProperties": False,
                    },
                }
            },
            "required": ["items"],
            "additionalProperties": False,
        },
        {"items": [{"sku": "A-17", "qty": 2}, {"sku": "B-4", "qty": 10}, {"sku": "C", "qty": 1}]},
    ),
    Case(
        "enums and bounded numbers",
        "json",
        {
            "type": "object",
            "properties": {
                "color": {"enum": ["red", "green", "blue"]},
                "size": {"type": "string", "enum": ["S", "M", "L", "XL"]},
                "price": {"type": "number", "minimum": 0, "maximum": 1000},
                "rating": {"type": "integer", "minimum": 1, "maximum": 5},
            },
            "required": ["color", "size", "price", "rating"],
            "additionalProperties": False,
        },
        {"color": "green", "size": "XL", "price": 129.5, "rating": 4},
    ),
    Case(
        "optional fields",
        "json",
        {
            "type": "object",
            "properties": {
                "title": {"type": "string"},
                "subtitle": {"type": "string"},
                "year": {"type": "integer"},
                "tags": {"type": "array", "items": {"type": "string"}, "maxItems": 5},
                "draft": {"type": "boolean"},
            },
            "required": ["title"],
            "additionalProperties": False,
        },
        {"title": "Caches", "year": 2024, "tags": ["kv", "paging"], "draft": False},
    ),
    Case(
        "any JSON object",
        "json",
        {"type": "object"},
        {"model": "smollm2", "params": {"t": 0.7, "stop": ["\n"], "n": 1}, "ok": True, "x": None},
    ),
    Case("regex (date time)", "regex", r"\d{4}-\d{2}-\d{2} [0-2]\d:[0-5]\d", "2024-06-01 13:45"),
    Case("choice", "choice", ["positive", "negative", "neutral"], "negative"),
]


def instance_text(case: Case) -> str:
    # json.dumps' default layout (", " and ": ", nothing else): the one tokenmill's grammars allow.
    return json.dumps(case.instance, ensure_ascii=False) if case.kind == "json" else case.instance


class LLGuidanceEngine:
    """The library as tokenmill uses it: a compiled grammar is a pristine matcher, deep-copied per request."""

    name = "llguidance"

    def __init__(self, tokenizer: Tokenizer, vocab_size: int, eos: list[int]) -> None:
        import llguidance
        import llguidance.torch

        self.ll = llguidance
        self.fill_fn = llguidance.torch.fill_next_token_bitmask
        self.tok = llguidance.LLTokenizer(tokenizer.backend.to_str(), n_vocab=vocab_size, eos_token=eos)
        self.templates: dict[str, Any] = {}

    def grammar(self, kind: str, spec: Any) -> str:
        if kind == "json":
            text = spec if isinstance(spec, str) else json.dumps(spec)
            return self.ll.LLMatcher.grammar_from_json_schema(text, overrides=JSON_LAYOUT)
        if kind == "regex":
            return self.ll.LLMatcher.grammar_from_regex(spec)
        return self.ll.grammar_from("choice", json.dumps(spec))

    def compile_cold(self, case: Case) -> Any:
        matcher = self.ll.LLMatcher(self.tok, self.grammar(case.kind, case.spec), log_level=0)
        assert not matcher.is_error(), matcher.get_error()
        self.templates[case.name] = matcher  # kept pristine: the caller gets a copy (~1 us) to walk
        return matcher.deep_copy()

    def compile_cached(self, case: Case) -> Any:
        return self.templates[case.name].deep_copy()

    def fill(self, matcher: Any, bitmask: torch.Tensor) -> None:
        self.fill_fn(matcher, bitmask, 0)

    def accept(self, matcher: Any, token: int) -> bool:
        return matcher.consume_token(token)

    def verdict(self, schema: dict, violating: str, tokenizer: Tokenizer) -> str:
        matcher = self.ll.LLMatcher(self.tok, self.grammar("json", schema), log_level=0)
        if matcher.is_error():
            return "refused"
        ids = tokenizer.encode(violating, add_special_tokens=False)
        whole = matcher.try_consume_tokens(ids) == len(ids) and matcher.is_accepting()
        return "let it through" if whole else "enforced"


class XGrammarEngine:
    """The library as vLLM uses it: a compiler with its cache, a GrammarMatcher per request. Same JSON
    layout as llguidance's; strict_mode off so that schemas mean what JSON Schema says."""

    name = "xgrammar"

    def __init__(self, tokenizer: Tokenizer, vocab_size: int, eos: list[int]) -> None:
        import transformers
        import xgrammar

        self.xgr = xgrammar
        hf = transformers.PreTrainedTokenizerFast(tokenizer_object=tokenizer.backend)
        info = xgrammar.TokenizerInfo.from_huggingface(hf, vocab_size=vocab_size, stop_token_ids=eos)
        self.compiler = xgrammar.GrammarCompiler(info, max_threads=1, cache_enabled=True)

    def compiled(self, kind: str, spec: Any) -> Any:
        if kind == "json":
            text = spec if isinstance(spec, str) else json.dumps(spec)
            return self.compiler.compile_json_schema(
                text, any_whitespace=False, separators=(", ", ": "), strict_mode=False
            )
        if kind == "regex":
            return self.compiler.compile_regex(spec)
        return self.compiler.compile_grammar("root ::= " + " | ".join(json.dumps(c) for c in spec))

    def compile_cold(self, case: Case) -> Any:
        self.compiler.clear_cache()
        return self.xgr.GrammarMatcher(self.compiled(case.kind, case.spec))

    def compile_cached(self, case: Case) -> Any:
        return self.xgr.GrammarMatcher(self.compiled(case.kind, case.spec))

    def fill(self, matcher: Any, bitmask: torch.Tensor) -> None:
        matcher.fill_next_token_bitmask(bitmask, 0)

    def accept(self, matcher: Any, token: int) -> bool:
        return matcher.accept_token(token)

    def verdict(self, schema: dict, violating: str, tokenizer: Tokenizer) -> str:
        try:
            matcher = self.xgr.GrammarMatcher(self.compiled("json", schema))
        except Exception:
            return "refused"
        ids = tokenizer.encode(violating, add_special_tokens=False) + [tokenizer.eos_token_id]
        return "let it through" if all(matcher.accept_token(t) for t in ids) else "enforced"


class TokenmillEngine:
    """tokenmill.structured itself (llguidance plus the EOS and accept bookkeeping)."""

    name = "tokenmill"

    def __init__(self, tokenizer: Tokenizer, vocab_size: int) -> None:
        self.backend = GrammarBackend(tokenizer, vocab_size)

    def compile_cached(self, case: Case) -> Any:
        spec = {"json": StructuredOutputs(json=json.dumps(case.spec))}.get(case.kind)
        if spec is None:
            spec = StructuredOutputs(**{case.kind: case.spec})
        return self.backend.matcher(spec)

    def fill(self, matcher: Any, bitmask: torch.Tensor) -> None:
        matcher.fill_bitmask(bitmask, 0)

    def accept(self, matcher: Any, token: int) -> bool:
        return matcher.accept(token)


# Schemas with a keyword one of the engines may not enforce, and a whole text (then EOS) that breaks it.
UNENFORCEABLE = [
    ({"not": {"type": "string"}}, '"a"'),
    ({"type": "array", "items": {"type": "integer"}, "contains": {"const": 7}}, "[1]"),
    ({"if": {"type": "integer"}, "then": {"minimum": 10}}, "3"),
    ({"type": "string", "format": "no-such-format"}, '"x"'),
    ({"type": "array", "items": {"type": "integer"}, "uniqueItems": True}, "[1, 1]"),
    ({"type": "integer", "multipleOf": 3}, "4"),
]


def median_time(fn: Callable[[], Any], reps: int) -> float:
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def walk(engine: Any, matcher: Any, tokens: list[int], bitmask: torch.Tensor, times: list[float]) -> None:
    """Fill + accept at every position of `tokens`, each time appended to `times`."""
    for t in tokens:
        t0 = time.perf_counter()
        engine.fill(matcher, bitmask)
        ok = engine.accept(matcher, t)
        times.append(time.perf_counter() - t0)
        assert ok, f"{engine.name} rejected token {t}"
        assert (bitmask[0, t // 32] >> (t % 32)) & 1, f"{engine.name} masked out a valid token"


def per_token(engine: Any, case: Case, tokens: list[int], vocab_size: int, walks: int) -> tuple[float, float]:
    """Median and 95th percentile of fill + accept per position over `walks` walks from cached grammars
    (the first walk after a cold compile is timed separately, by first_walk)."""
    bitmask = allocate_bitmask(1, vocab_size)
    walk(engine, engine.compile_cached(case), tokens, bitmask, [])  # warm the lazily built parts
    times: list[float] = []
    for _ in range(walks):
        walk(engine, engine.compile_cached(case), tokens, bitmask, times)
    times.sort()
    return statistics.median(times), times[int(0.95 * (len(times) - 1))]


def first_walk(engine: Any, case: Case, tokens: list[int], vocab_size: int, reps: int) -> float:
    """From nothing to the end of the text: a cold compile, then the whole walk (llguidance builds its
    lexer lazily, during the first masks, xgrammar while compiling)."""
    bitmask = allocate_bitmask(1, vocab_size)
    return median_time(lambda: walk(engine, engine.compile_cold(case), tokens, bitmask, []), reps)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--walks", type=int, default=5, help="timed walks of each text per engine")
    parser.add_argument("--cold", type=int, default=5, help="cold compiles (and first walks) per case")
    parser.add_argument("--cached", type=int, default=50, help="cached compiles per case")
    args = parser.parse_args()
    torch.set_num_threads(1)

    tokenizer = load_tokenizer(resolve("smollm2-135m"), None)
    vocab_size = tokenizer.vocab_size
    eos = sorted(tokenizer.eos_token_ids)
    t0 = time.perf_counter()
    ll = LLGuidanceEngine(tokenizer, vocab_size, eos)
    t_ll = time.perf_counter() - t0
    t0 = time.perf_counter()
    xg = XGrammarEngine(tokenizer, vocab_size, eos)
    t_xg = time.perf_counter() - t0
    tm = TokenmillEngine(tokenizer, vocab_size)
    print(f"tokenizer set-up (once per engine): llguidance {t_ll * 1e3:.0f} ms, xgrammar {t_xg * 1e3:.0f} ms")
    print(f"vocab {vocab_size}, EOS {eos}, one thread (torch, xgrammar compiler)\n")

    head = (
        f"{'case':26} {'tok':>3} | {'compile cold ms':>15} {'':>5} | {'1st walk ms':>11} {'':>5} | "
        f"{'cached us':>9} {'':>5} | {'per token us':>12} {'':>5} {'ll/xg':>5} | {'p95 us':>6} {'':>5} | "
        f"{'tokenmill':>9}"
    )
    print(head)
    sub = (
        f"{'':26} {'':>3} | {'ll':>15} {'xg':>5} | {'ll':>11} {'xg':>5} | {'ll':>9} {'xg':>5} | "
        f"{'ll':>12} {'xg':>5} {'':>5} | {'ll':>6} {'xg':>5} | {'us/token':>9}"
    )
    print(sub)
    print("-" * len(head))
    ratios = []
    for case in CASES:
        tokens = tokenizer.encode(instance_text(case), add_special_tokens=False) + [eos[0]]
        row = {}
        for engine in (ll, xg):
            cold = median_time(lambda e=engine, c=case: e.compile_cold(c), args.cold)
            first = first_walk(engine, case, tokens, vocab_size, args.cold)
            cached = median_time(lambda e=engine, c=case: e.compile_cached(c), args.cached)
            med, p95 = per_token(engine, case, tokens, vocab_size, args.walks)
            row[engine.name] = (cold, first, cached, med, p95)
        ours, _ = per_token(tm, case, tokens, vocab_size, args.walks)
        a, b = row["llguidance"], row["xgrammar"]
        ratios.append(a[3] / b[3])
        print(
            f"{case.name:26} {len(tokens):>3} | {a[0] * 1e3:>15.2f} {b[0] * 1e3:>5.2f} | "
            f"{a[1] * 1e3:>11.2f} {b[1] * 1e3:>5.2f} | {a[2] * 1e6:>9.1f} {b[2] * 1e6:>5.1f} | "
            f"{a[3] * 1e6:>12.1f} {b[3] * 1e6:>5.1f} {a[3] / b[3]:>5.2f} | "
            f"{a[4] * 1e6:>6.1f} {b[4] * 1e6:>5.1f} | {ours * 1e6:>9.1f}"
        )
    print(f"\nper-token ratio llguidance/xgrammar, median over cases: {statistics.median(ratios):.2f}")

    print("\nschemas with a keyword an engine may not enforce, and a text that breaks it:")
    for schema, violating in UNENFORCEABLE:
        verdicts = {e.name: e.verdict(schema, violating, tokenizer) for e in (ll, xg)}
        print(
            f"  {json.dumps(schema):75} {violating:8} "
            f"ll: {verdicts['llguidance']:15} xg: {verdicts['xgrammar']}"
        )

    logits = torch.randn(32, 49152)
    bitmask = allocate_bitmask(32, 49152)
    bitmask.random_(-(2**31), 2**31 - 1)
    apply_bitmask(logits, bitmask)  # warm-up
    cost = median_time(lambda: apply_bitmask(logits, bitmask), 50)
    half = median_time(lambda: apply_bitmask(logits, bitmask, rows=list(range(0, 32, 2))), 50)
    xg_cost = median_time(lambda: xg.xgr.apply_token_bitmask_inplace(logits, bitmask), 50)
    print(
        f"\napply_bitmask (32, 49152) float32 logits, one thread: {cost * 1e3:.2f} ms all rows, "
        f"{half * 1e3:.2f} ms 16 rows (xgrammar's compiled CPU kernel, for scale: {xg_cost * 1e3:.2f} ms)"
    )


if __name__ == "__main__":
    main()
