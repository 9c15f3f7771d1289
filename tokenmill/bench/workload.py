"""What the load generator sends: sessions of one or more turns, built from a workload description.

A session is one conversation: a single request for most workloads, several turns that resend the
growing history for multi-turn ones. Prompts are synthetic word sequences counted exactly in tokens
with the model's tokenizer when one is available (otherwise at 0.75 words per token, said loudly), a
JSONL file of prompts, or a use-case preset's length shape. Every prompt starts differently, so no
two requests share a cached prefix unless the workload asks for one (shared-prefix groups).
"""

from __future__ import annotations

import json
import random
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

WORDS_PER_TOKEN = 0.75  # the usual rule of thumb for English (bench without a tokenizer; sizing)

# Use-case shapes from the source documents (../shared/seeds/002: translation, generation,
# summarization, reasoning; 000: chatbot, question answering/RAG; 004: 2000 in / 200 out).
# (isl mean, isl std, osl mean, osl std, description)
PRESETS: dict[str, tuple[int, int, int, int, str]] = {
    "chatbot": (200, 50, 150, 40, "short questions, moderate answers; TTFT matters most"),
    "rag": (2000, 400, 200, 50, "question answering over retrieved context: long input, short output"),
    "summarization": (3000, 600, 150, 30, "ISL O(1000) much longer than OSL O(100)"),
    "translation": (800, 200, 800, 200, "similar input and output of roughly 500-2000 tokens"),
    "generation": (100, 20, 1000, 200, "code, stories, email: OSL O(1000) from ISL O(100)"),
    "reasoning": (100, 20, 4000, 1000, "short question, long chain of thought: OSL O(1000-10000)"),
}

_VOCAB = (  # noqa: SIM905 (a word list reads better as text)
    "time year people way day man thing woman life child world school state family student group country "
    "problem hand part place case week company system program question work government number night point "
    "home water room mother area money story fact month lot right study book eye job word business issue "
    "side kind head house service friend father power hour game line end member law car city community "
    "name president team minute idea kid body information back parent face others level office door "
    "health person art war history party result change morning reason research girl guy moment air "
    "teacher force education foot boy age policy process music market sense nation plan college interest "
    "death experience effect use class control care field development role effort rate heart drug show "
    "leader light voice wife police mind price report decision son view relationship town road arm "
    "difference value building action model season society tax director position player record paper "
    "space ground form event official matter center couple site project activity star table need court "
    "oil situation cost industry figure street image phone data picture practice piece land product "
    "doctor wall patient worker news test movie north love support technology step baby computer type "
    "attention film tree source organization hair window evidence population site energy blue river quick "
    "slow bright quiet small large early late simple strong clear open green careful gentle makes takes "
    "gives finds tells asks works seems feels leaves calls keeps brings begins shows hears plays runs "
    "moves lives believes holds writes provides sits stands loses pays meets includes"
).split()


class TokenCounter(Protocol):
    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]: ...

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str: ...


@dataclass
class Turn:
    text: str  # the user's message (chat) or the prompt text (completions)
    max_tokens: int
    prompt_tokens: int  # tokens of `text` alone (exact with a tokenizer, else estimated)


@dataclass
class Session:
    turns: list[Turn]
    system: str | None = None  # a shared prefix: the system message, or the prompt's start
    messages: list[dict] | None = None  # a file's own messages (single turn), used as given


@dataclass
class WorkloadConfig:
    isl: int = 512
    isl_std: float = 0.0
    osl: int = 128
    osl_std: float = 0.0
    preset: str | None = None
    prefix_groups: int = 0  # G groups sharing a system prompt of prefix_tokens
    prefix_tokens: int = 0
    turns: int = 1  # turns per conversation (history resent each turn)
    input_file: str | None = None  # JSONL: {"prompt"|"text": str} or {"messages": [...]}, opt. max_tokens
    seed: int = 0
    extra: dict = field(default_factory=dict)

    def resolved(self) -> WorkloadConfig:
        """This config with a preset's lengths filled in."""
        if self.preset is None:
            return self
        if self.preset not in PRESETS:
            raise ValueError(f"unknown preset {self.preset!r}: use one of {', '.join(PRESETS)}")
        isl, isl_std, osl, osl_std, _ = PRESETS[self.preset]
        return WorkloadConfig(
            **{**self.__dict__, "isl": isl, "isl_std": isl_std, "osl": osl, "osl_std": osl_std}
        )


class PromptMaker:
    """Random word sequences of an exact token count."""

    def __init__(self, counter: TokenCounter | None, rng: random.Random) -> None:
        self.counter = counter
        self.rng = rng

    def count(self, text: str) -> int:
        if self.counter is None:
            return max(1, round(len(text.split()) / WORDS_PER_TOKEN))
        return len(self.counter.encode(text, add_special_tokens=False))

    def make(self, n: int) -> tuple[str, int]:
        """A text of n tokens (exactly, when a tokenizer is available); returns it and its count."""
        n = max(1, n)
        if self.counter is None:
            words = max(1, round(n * WORDS_PER_TOKEN))
            return " ".join(self.rng.choices(_VOCAB, k=words)), n
        words = self.rng.choices(_VOCAB, k=n + 8)  # common words are one token each, mostly
        ids = self.counter.encode(" ".join(words), add_special_tokens=False)
        while len(ids) < n:
            ids += self.counter.encode(
                " " + " ".join(self.rng.choices(_VOCAB, k=n)), add_special_tokens=False
            )
        text = self.counter.decode(ids[:n])
        # Cutting at a token boundary and decoding re-encodes to the same ids for plain words; if it
        # does not, trim a token at a time so the count never exceeds what was asked.
        for cut in range(n, max(0, n - 4), -1):
            text = self.counter.decode(ids[:cut])
            got = self.count(text)
            if got <= n:
                return text, got
        return text, self.count(text)


def _length(rng: random.Random, mean: float, std: float) -> int:
    return max(1, round(rng.gauss(mean, std))) if std > 0 else max(1, round(mean))


def sessions(cfg: WorkloadConfig, counter: TokenCounter | None) -> Iterator[Session]:
    """An endless stream of sessions (a file's prompts repeat in order)."""
    cfg = cfg.resolved()
    rng = random.Random(cfg.seed)
    maker = PromptMaker(counter, rng)
    if cfg.input_file:
        yield from _file_sessions(Path(cfg.input_file), cfg, maker, rng)
        return
    prefixes = (
        [maker.make(cfg.prefix_tokens)[0] for _ in range(cfg.prefix_groups)] if cfg.prefix_tokens else []
    )
    i = 0
    while True:
        turns = []
        for _ in range(max(1, cfg.turns)):
            text, n = maker.make(_length(rng, cfg.isl, cfg.isl_std))
            turns.append(Turn(text, _length(rng, cfg.osl, cfg.osl_std), n))
        yield Session(turns, system=prefixes[i % len(prefixes)] if prefixes else None)
        i += 1


def _file_sessions(
    path: Path, cfg: WorkloadConfig, maker: PromptMaker, rng: random.Random
) -> Iterator[Session]:
    entries = []
    with path.open(encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                d = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{path}:{lineno}: not JSON ({e.msg})") from None
            if not isinstance(d, dict) or not any(k in d for k in ("prompt", "text", "messages")):
                raise ValueError(f"{path}:{lineno}: expected an object with 'prompt', 'text' or 'messages'")
            entries.append(d)
    if not entries:
        raise ValueError(f"{path}: no prompts in the file")
    while True:
        for d in entries:
            max_tokens = int(
                d.get("max_tokens") or d.get("output_length") or _length(rng, cfg.osl, cfg.osl_std)
            )
            if "messages" in d:
                text = "\n".join(str(m.get("content", "")) for m in d["messages"])
                yield Session([Turn(text, max_tokens, maker.count(text))], messages=d["messages"])
            else:
                text = str(d.get("prompt", d.get("text")))
                yield Session([Turn(text, max_tokens, maker.count(text))])


def load_counter(spec: str | None, model: str | None) -> tuple[TokenCounter | None, str]:
    """The tokenizer used to count tokens, and a description of it.

    spec: a catalog name, a .gguf file, a Hugging Face directory or tokenizer.json, 'none' for the
    words-per-token estimate, or None to use the served model's tokenizer when it is a catalog model.
    """
    from tokenmill.tokenizer.tokenizer import Tokenizer
    from tokenmill.weights import catalog

    if spec == "none":
        return None, f"none (estimated at {WORDS_PER_TOKEN} words per token)"
    target = spec or model
    if target in catalog.CATALOG:
        path = catalog.installed_file(catalog.CATALOG[target])
        if path is None:
            if spec:
                raise ValueError(
                    f"catalog model {target!r} is not installed: run tokenmill models pull {target}"
                )
        else:
            from tokenmill.weights.tokenizer_source import load_tokenizer

            return load_tokenizer(path, None), f"{target} ({path.name})"
    elif spec:
        p = Path(spec)
        if p.is_file() and p.suffix == ".gguf":
            from tokenmill.weights.tokenizer_source import load_tokenizer

            return load_tokenizer(p, None), str(p)
        if p.is_file() and p.name == "tokenizer.json":
            return Tokenizer.from_dir(p.parent), str(p)
        if p.is_dir() and (p / "tokenizer.json").is_file():
            return Tokenizer.from_dir(p), str(p)
        raise ValueError(
            f"tokenizer {spec!r} is not a catalog name, a .gguf file or a tokenizer.json/directory"
        )
    return None, f"none (estimated at {WORDS_PER_TOKEN} words per token; pass --tokenizer for exact counts)"
