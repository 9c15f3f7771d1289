"""Building a Hugging Face `tokenizers.Tokenizer` from the tokenizer a GGUF file describes.

A GGUF carries no tokenizer.json: it stores the vocabulary, merges, scores, token types and special
token ids as metadata under llama.cpp's key names (`tokenizer.ggml.*`). Two families are supported:

* `tokenizer.ggml.model == "gpt2"`: byte-level BPE with explicit merges. How text is split before
  BPE depends on `tokenizer.ggml.pre`; see `PRE_TOKENIZER_SPLITS` for the variants we know.
* `tokenizer.ggml.model == "llama"`: SentencePiece BPE (Llama 2, Mistral...). Merges are taken from
  the file, or derived from the piece scores, and unknown characters fall back to `<0xNN>` tokens.

Anything else raises `ValueError` naming the tokenizer, rather than tokenizing text wrongly.
"""

from __future__ import annotations

from collections.abc import Sequence
from functools import cache
from typing import Any

from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers, processors

# llama.cpp's token types (enum llama_token_type).
TOKEN_TYPE_NORMAL = 1
TOKEN_TYPE_UNKNOWN = 2
TOKEN_TYPE_CONTROL = 3
TOKEN_TYPE_USER_DEFINED = 4
TOKEN_TYPE_BYTE = 6

# Split patterns of the byte-level pre-tokenizers, by `tokenizer.ggml.pre`. These are the regexes the
# models' own tokenizer.json files use (and llama.cpp reproduces).
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
# None means "the GPT-2 regex built into tokenizers' ByteLevel pre-tokenizer".
_GPT2_SPLIT = None
# A marker for the StarCoder-style vocabularies: every digit is its own pre-token, then GPT-2's regex.
_DIGITS_THEN_GPT2 = "digits+gpt2"

PRE_TOKENIZER_SPLITS: dict[str, str | None] = {
    "default": _GPT2_SPLIT,
    "gpt2": _GPT2_SPLIT,
    "gpt-2": _GPT2_SPLIT,
    "llama-bpe": _LLAMA3_SPLIT,
    "llama3": _LLAMA3_SPLIT,
    "llama-v3": _LLAMA3_SPLIT,
    "smaug-bpe": _LLAMA3_SPLIT,
    "falcon3": _LLAMA3_SPLIT,
    "qwen2": _QWEN2_SPLIT,
    "deepseek-r1-qwen": _QWEN2_SPLIT,
    "smollm": _DIGITS_THEN_GPT2,
    "starcoder": _DIGITS_THEN_GPT2,
    "refact": _DIGITS_THEN_GPT2,
}

SUPPORTED_MODELS = ("gpt2", "llama")


def tokenizer_from_gguf(metadata: dict[str, Any]) -> tuple[Tokenizer, dict[str, Any]]:
    """Build the tokenizer a GGUF file's metadata describes.

    Returns `(tokenizer, config)`, where `config` is shaped like Hugging Face's
    tokenizer_config.json: `bos_token`, `eos_token`, `pad_token`, `unk_token` (token strings or
    None), `add_bos_token`, `add_eos_token` and `chat_template` (string or None). The tokenizer's
    post-processor already adds BOS/EOS as those flags say.

    Raises ValueError for a tokenizer model or pre-tokenizer we do not support.
    """
    kind = metadata.get("tokenizer.ggml.model")
    tokens: list[str] = list(metadata["tokenizer.ggml.tokens"])
    token_types: list[int] = list(
        metadata.get("tokenizer.ggml.token_type") or [TOKEN_TYPE_NORMAL] * len(tokens)
    )
    unk_id = metadata.get("tokenizer.ggml.unknown_token_id")
    if unk_id is not None and token_types[unk_id] == TOKEN_TYPE_UNKNOWN:
        # Hugging Face treats the unknown token as special (matched whole, dropped when decoding).
        token_types[unk_id] = TOKEN_TYPE_CONTROL
    if kind == "gpt2":
        tokenizer = _byte_level_bpe(metadata, tokens, token_types)
    elif kind == "llama":
        tokenizer = _sentencepiece_bpe(metadata, tokens, token_types)
    else:
        raise ValueError(
            f"unsupported GGUF tokenizer model {kind!r} (tokenizer.ggml.model); "
            f"supported: {', '.join(SUPPORTED_MODELS)}"
        )
    _add_special_tokens(tokenizer, tokens, token_types)

    config = _config(metadata, tokens, kind)
    post_processor = _bos_eos_post_processor(
        tokenizer, config["bos_token"], config["eos_token"], config["add_bos_token"], config["add_eos_token"]
    )
    if post_processor is not None:
        tokenizer.post_processor = post_processor
    return tokenizer, config


def _bos_eos_post_processor(
    tokenizer: Tokenizer, bos_token: str | None, eos_token: str | None, add_bos: bool, add_eos: bool
) -> processors.TemplateProcessing | None:
    """A post-processor adding BOS and/or EOS around each sequence as the flags say, or None when
    there is nothing to add (or the token cannot be written in a template: it contains ':' or spaces)."""
    around = {"bos": bos_token if add_bos else None, "eos": eos_token if add_eos else None}
    ids = {}
    for name, token in around.items():
        if token is None or tokenizer.token_to_id(token) is None:
            around[name] = None
        elif ":" in token or token != "".join(token.split()):
            return None
        else:
            ids[token] = tokenizer.token_to_id(token)
    if not ids:
        return None

    def sequence(name: str, type_id: int) -> list[str]:
        pieces = [f"${name}:{type_id}"]
        if around["bos"] is not None:
            pieces.insert(0, f"{around['bos']}:{type_id}")
        if around["eos"] is not None:
            pieces.append(f"{around['eos']}:{type_id}")
        return pieces

    return processors.TemplateProcessing(
        single=sequence("A", 0), pair=sequence("A", 0) + sequence("B", 1), special_tokens=list(ids.items())
    )


def _byte_level_bpe(metadata: dict[str, Any], tokens: list[str], token_types: list[int]) -> Tokenizer:
    pre = metadata.get("tokenizer.ggml.pre", "default")
    if pre not in PRE_TOKENIZER_SPLITS:
        raise ValueError(
            f"unsupported GGUF pre-tokenizer {pre!r} (tokenizer.ggml.pre) for a byte-level BPE vocabulary; "
            f"supported: {', '.join(sorted(PRE_TOKENIZER_SPLITS))}"
        )
    alphabet = _byte_alphabet()
    vocab: dict[str, int] = {}
    for index, (token, token_type) in enumerate(zip(tokens, token_types, strict=True)):
        if not set(token) <= alphabet and token_type not in (TOKEN_TYPE_CONTROL, TOKEN_TYPE_USER_DEFINED):
            # A regular token must be spelled in the byte alphabet for BPE to ever produce it. Control and
            # user-defined tokens stay as written: they are matched whole in the raw text (as llama.cpp
            # does), and the ByteLevel decoder emits a token it cannot map as its raw UTF-8.
            token = "".join(_byte_to_char()[b] for b in token.encode("utf-8"))
        vocab[token] = index  # a token listed twice keeps its last id, as in llama.cpp
    merges = [_split_merge(merge) for merge in metadata.get("tokenizer.ggml.merges") or ()]
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=False, byte_fallback=False))
    tokenizer.pre_tokenizer = _byte_level_pre_tokenizer(PRE_TOKENIZER_SPLITS[pre])
    tokenizer.decoder = decoders.ByteLevel()
    return tokenizer


def _byte_level_pre_tokenizer(split: str | None) -> pre_tokenizers.PreTokenizer:
    if split is _GPT2_SPLIT:
        return pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    if split == _DIGITS_THEN_GPT2:
        return pre_tokenizers.Sequence(
            [pre_tokenizers.Digits(individual_digits=True), pre_tokenizers.ByteLevel(add_prefix_space=False)]
        )
    return pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(split), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )


def _sentencepiece_bpe(metadata: dict[str, Any], tokens: list[str], token_types: list[int]) -> Tokenizer:
    # A token listed twice keeps its last id, as in llama.cpp's token-to-id map.
    vocab = {token: index for index, token in enumerate(tokens)}
    if metadata.get("tokenizer.ggml.merges"):
        merges = [_split_merge(merge) for merge in metadata["tokenizer.ggml.merges"]]
    elif "tokenizer.ggml.scores" in metadata:
        merges = merges_from_scores(tokens, metadata["tokenizer.ggml.scores"])
    else:
        raise ValueError(
            "GGUF SentencePiece tokenizer has neither tokenizer.ggml.merges nor tokenizer.ggml.scores"
        )
    unk_id = metadata.get("tokenizer.ggml.unknown_token_id")
    unk = tokens[unk_id] if unk_id is not None else None
    tokenizer = Tokenizer(
        models.BPE(vocab=vocab, merges=merges, unk_token=unk, fuse_unk=True, byte_fallback=True)
    )
    # SentencePiece marks word starts with U+2581 and, unless the file says otherwise, treats the text
    # as if it began with a space ("first": only at the very start, not after each special token).
    prefix_space = bool(metadata.get("tokenizer.ggml.add_space_prefix", True))
    tokenizer.pre_tokenizer = pre_tokenizers.Metaspace(
        replacement="\u2581", prepend_scheme="first" if prefix_space else "never", split=False
    )
    steps = [decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse()]
    if prefix_space:
        steps.append(decoders.Strip(content=" ", left=1, right=0))
    tokenizer.decoder = decoders.Sequence(steps)
    return tokenizer


def merges_from_scores(tokens: Sequence[str], scores: Sequence[float]) -> list[tuple[str, str]]:
    """Recover BPE merges from a SentencePiece vocabulary: every way to cut a piece into two pieces
    that are both in the vocabulary is a merge, ranked by the merged piece's score (best first).

    Ties are broken the way Hugging Face's converter does (the longer left part first, then the
    vocabulary order), so the result tokenizes identically to transformers' GGUF loader.
    """
    ids = {token: index for index, token in enumerate(tokens)}
    score_of: dict[str, float] = {}
    for token, score in zip(tokens, scores, strict=True):
        score_of[token] = float(score)  # a repeated piece keeps its last score, like a dict built in one pass
    candidates: list[tuple[str, str, float]] = []
    for piece, score in score_of.items():
        cuts = [(piece[:i], piece[i:]) for i in range(1, len(piece)) if piece[:i] in ids and piece[i:] in ids]
        cuts.sort(key=lambda cut: (ids[cut[0]], ids[cut[1]]))
        candidates.extend((left, right, score) for left, right in cuts)
    # A stable sort on the descending key keeps the per-piece order among equal keys.
    candidates.sort(key=lambda c: (c[2], len(c[0]), len(c[1])), reverse=True)
    return [(left, right) for left, right, _ in candidates]


def _add_special_tokens(tokenizer: Tokenizer, tokens: list[str], token_types: list[int]) -> None:
    """Control tokens become special added tokens (matched whole in text, dropped by
    skip_special_tokens); user-defined ones become plain added tokens (matched whole, always decoded)."""
    vocab = tokenizer.get_vocab()
    control, user = [], []
    for token, token_type in zip(tokens, token_types, strict=True):
        if token not in vocab:
            continue  # respelled into the byte alphabet: the raw form has no id
        if token_type == TOKEN_TYPE_CONTROL:
            control.append(AddedToken(token, special=True, normalized=False))
        elif token_type == TOKEN_TYPE_USER_DEFINED:
            user.append(AddedToken(token, special=False, normalized=False))
    if control:
        tokenizer.add_special_tokens(control)
    if user:
        tokenizer.add_tokens(user)


def _config(metadata: dict[str, Any], tokens: list[str], kind: str) -> dict[str, Any]:
    def token(key: str) -> str | None:
        index = metadata.get(f"tokenizer.ggml.{key}")
        return tokens[index] if index is not None and 0 <= index < len(tokens) else None

    # Files that predate the flag: llama.cpp adds BOS for SentencePiece vocabularies, not for BPE ones.
    add_bos = metadata.get("tokenizer.ggml.add_bos_token", kind == "llama")
    return {
        "bos_token": token("bos_token_id"),
        "eos_token": token("eos_token_id"),
        "pad_token": token("padding_token_id"),
        "unk_token": token("unknown_token_id"),
        "add_bos_token": bool(add_bos),
        "add_eos_token": bool(metadata.get("tokenizer.ggml.add_eos_token", False)),
        "chat_template": metadata.get("tokenizer.chat_template"),
    }


def _split_merge(merge: str) -> tuple[str, str]:
    left, _, right = merge.partition(" ")
    return left, right


@cache
def _byte_to_char() -> dict[int, str]:
    """GPT-2's reversible byte -> printable character map: printable Latin-1 bytes map to
    themselves, the rest to code points from 256 up, in byte order."""
    printable = [
        *range(ord("!"), ord("~") + 1),
        *range(ord("¡"), ord("¬") + 1),
        *range(ord("®"), ord("ÿ") + 1),
    ]
    mapping = {b: chr(b) for b in printable}
    extra = 0
    for b in range(256):
        if b not in mapping:
            mapping[b] = chr(256 + extra)
            extra += 1
    return mapping


@cache
def _byte_alphabet() -> frozenset[str]:
    return frozenset(_byte_to_char().values())
