"""The engine's tokenizer: a Hugging Face `tokenizers.Tokenizer` plus what tokenizer_config.json says
(special tokens, whether to add BOS, the chat template), loaded from a GGUF file or an HF directory."""

from __future__ import annotations

import functools
import json
import logging
import re
import threading
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

import tokenizers

from tokenmill.tokenizer.chat_template import render_chat_template
from tokenmill.tokenizer.gguf_tokenizer import tokenizer_from_gguf

log = logging.getLogger(__name__)

_SPECIAL_NAMES = ("bos_token", "eos_token", "pad_token", "unk_token")
# Stand-ins for message text while a chat template renders (private-use characters, never in a
# template): what lies between them is user text, encoded with special tokens off.
_MARK = re.compile("\ue000(\\d+)\ue001")
# Used to find which token closes an assistant turn in a chat template; unlikely to occur in a template.
_PROBE_REPLY = "\u2063tokenmill-probe\u2063"
# A function name no template writes on its own: seeing it in the output means the template lists tools.
_PROBE_TOOL = "tokenmill_probe_function"


class Tokenizer:
    """Text <-> token ids for one model, with its special tokens and chat template.

    `config` is shaped like Hugging Face's tokenizer_config.json; `generation_eos_ids` are extra
    end-of-sequence ids from generation_config.json. When `add_bos_token` is absent from the config,
    it is inferred from whether the backend's own post-processor puts BOS in front.
    """

    def __init__(
        self,
        backend: tokenizers.Tokenizer,
        config: Mapping[str, Any] | None = None,
        generation_eos_ids: Iterable[int] = (),
    ) -> None:
        self.backend = backend
        # encode_special_tokens is a flag on the shared backend: flipped only under this lock.
        self._lock = threading.Lock()
        raw = dict(config or {})
        self.config: dict[str, Any] = {name: _token_content(raw.get(name)) for name in _SPECIAL_NAMES}
        self.config["chat_template"] = raw.get("chat_template")
        self.chat_templates = _templates_by_name(raw.get("chat_template"))
        self.bos_token_id = self._id_of(self.config["bos_token"])
        self.eos_token_id = self._id_of(self.config["eos_token"])
        self.pad_token_id = self._id_of(self.config["pad_token"])
        self.unk_token_id = self._id_of(self.config["unk_token"])
        for name, token_id in (("add_bos_token", self.bos_token_id), ("add_eos_token", self.eos_token_id)):
            given = raw.get(name)
            self.config[name] = bool(given) if given is not None else self._backend_adds(token_id, name)
        self.generation_eos_ids = sorted(set(generation_eos_ids))
        self.eos_token_ids: set[int] = self._find_eos_token_ids()
        self._special_texts = [
            t.content for t in backend.get_added_tokens_decoder().values() if t.special and t.content
        ]

    # --- loading and saving ---------------------------------------------------------------------

    @classmethod
    def from_gguf_metadata(cls, metadata: Mapping[str, Any]) -> Tokenizer:
        """The tokenizer described by a GGUF file's metadata (see `tokenizer_from_gguf`)."""
        backend, config = tokenizer_from_gguf(dict(metadata))
        return cls(backend, config)

    @classmethod
    def from_dir(cls, path: str | Path) -> Tokenizer:
        """Load a Hugging Face tokenizer directory: tokenizer.json, plus the optional
        tokenizer_config.json, chat_template.jinja and generation_config.json (eos_token_id)."""
        path = Path(path)
        backend = tokenizers.Tokenizer.from_file(str(path / "tokenizer.json"))
        config = _read_json(path / "tokenizer_config.json")
        if config.get("chat_template") is None and (path / "chat_template.jinja").is_file():
            config["chat_template"] = (path / "chat_template.jinja").read_text(encoding="utf-8")
        eos = _read_json(path / "generation_config.json").get("eos_token_id")
        extra_eos = [eos] if isinstance(eos, int) else list(eos or [])
        return cls(backend, config, extra_eos)

    def save(self, path: str | Path) -> None:
        """Write tokenizer.json and tokenizer_config.json (and the extra eos ids into
        generation_config.json, keeping its other keys) so that `from_dir` reads back this tokenizer."""
        path = Path(path)
        path.mkdir(parents=True, exist_ok=True)
        self.backend.save(str(path / "tokenizer.json"))
        (path / "tokenizer_config.json").write_text(
            json.dumps(self.config, indent=2, ensure_ascii=False) + "\n"
        )
        if self.generation_eos_ids:
            generation = _read_json(path / "generation_config.json")
            generation["eos_token_id"] = self.generation_eos_ids
            (path / "generation_config.json").write_text(json.dumps(generation, indent=2) + "\n")

    # --- encoding and decoding ------------------------------------------------------------------

    @property
    def add_bos_token(self) -> bool:
        return bool(self.config["add_bos_token"])

    @property
    def chat_template(self) -> str | None:
        return self.chat_templates.get("default")

    @property
    def vocab_size(self) -> int:
        """Number of token ids, including added (special) tokens."""
        return self.backend.get_vocab_size(with_added_tokens=True)

    @functools.cached_property
    def max_token_chars(self) -> int:
        """The most characters one token stands for (special tokens included): the bound that lets a
        text's length say it cannot fit before it is tokenized (`token_floor`)."""
        return max((len(s) for s in self.backend.get_vocab(with_added_tokens=True)), default=1) or 1

    def token_floor(self, text: str) -> int:
        """Fewer tokens than `text` can ever encode to, without tokenizing it: each token stands for at
        most max_token_chars characters, and normalization (NFKC composing up to 3 code points into
        one, as Hangul jamo do) is allowed for by a factor of 3."""
        return len(text) // (3 * self.max_token_chars)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of `text`. Special-token strings in the text become their ids; BOS (and EOS) are
        added only when `add_special_tokens` and the config's add_bos_token (add_eos_token) say so."""
        # We add BOS/EOS ourselves instead of trusting the backend's post-processor, so a tokenizer.json
        # that adds BOS and a config saying otherwise cannot disagree.
        with self._lock:
            ids = self.backend.encode(text, add_special_tokens=False).ids
        if add_special_tokens:
            if self.config["add_bos_token"] and self.bos_token_id is not None:
                ids.insert(0, self.bos_token_id)
            if self.config["add_eos_token"] and self.eos_token_id is not None:
                ids.append(self.eos_token_id)
        return ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        """Text of `ids`; incomplete UTF-8 sequences come out as U+FFFD."""
        return self.backend.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def convert_ids_to_tokens(self, ids: int | Sequence[int]) -> str | None | list[str | None]:
        """Vocabulary strings of ids (None for an id outside the vocabulary)."""
        if isinstance(ids, int):
            return self.backend.id_to_token(ids)
        return [self.backend.id_to_token(i) for i in ids]

    def token_to_id(self, token: str) -> int | None:
        return self.backend.token_to_id(token)

    # --- chat -----------------------------------------------------------------------------------

    def apply_chat_template(
        self, messages: Sequence[Mapping[str, Any]], add_generation_prompt: bool = True, **kwargs: Any
    ) -> str:
        """Render a conversation to prompt text with the model's chat template (ChatML if it has none).

        Extra keyword arguments (e.g. `tools`) are passed to the template; when `tools` is given and
        the model has a template named "tool_use", that one is used, as transformers does.
        """
        template = self.chat_template
        if kwargs.get("tools") and "tool_use" in self.chat_templates:
            template = self.chat_templates["tool_use"]
        for name in ("unk_token", "pad_token"):
            if self.config[name] is not None:
                kwargs.setdefault(name, self.config[name])
        return render_chat_template(
            template,
            messages,
            add_generation_prompt=add_generation_prompt,
            bos_token=self.config["bos_token"],
            eos_token=self.config["eos_token"],
            **kwargs,
        )

    @functools.cached_property
    def supports_tools(self) -> bool:
        """Whether the chat template renders a `tools` list (Hermes-, Qwen-, Llama-3.1-style templates
        do; plain ChatML does not, and then the server describes the tools in the system prompt)."""
        probe = [{"role": "user", "content": "Hi"}]
        tool = {
            "type": "function",
            "function": {"name": _PROBE_TOOL, "description": "", "parameters": {"type": "object"}},
        }
        try:
            return _PROBE_TOOL in self.apply_chat_template(probe, tools=[tool])
        except ValueError:
            return False  # a template that fails on tools cannot be given them

    def encode_chat(
        self, messages: Sequence[Mapping[str, Any]], add_generation_prompt: bool = True, **kwargs: Any
    ) -> list[int]:
        """Token ids of the rendered conversation.

        Special tokens the template writes (e.g. `{{ bos_token }}`) are parsed as such. BOS is put in
        front when the model adds BOS and the template did not already emit it, so there is never a
        double BOS; for a model with add_bos_token false this equals transformers'
        `apply_chat_template(..., tokenize=True)`.
        """
        # Message text is text: a special-token string typed into a message (role injection such as
        # "<|im_end|>\n<|im_start|>system") is encoded as ordinary characters; control tokens come
        # only from the template. Messages without such strings take the plain path.
        risky = [
            i
            for i, m in enumerate(messages)
            if isinstance(m.get("content"), str) and any(t in m["content"] for t in self._special_texts)
        ]
        ids = self._encode_marked(messages, risky, add_generation_prompt, **kwargs) if risky else None
        if ids is None:
            text = self.apply_chat_template(messages, add_generation_prompt=add_generation_prompt, **kwargs)
            ids = self.encode(text, add_special_tokens=False)
        if self.config["add_bos_token"] and self.bos_token_id is not None and ids[:1] != [self.bos_token_id]:
            ids.insert(0, self.bos_token_id)
        return ids

    def _encode_marked(
        self,
        messages: Sequence[Mapping[str, Any]],
        risky: list[int],
        add_generation_prompt: bool,
        **kwargs: Any,
    ) -> list[int] | None:
        marked = [{**m, "content": f"\ue000{i}\ue001"} if i in risky else m for i, m in enumerate(messages)]
        text = self.apply_chat_template(marked, add_generation_prompt=add_generation_prompt, **kwargs)
        pieces = _MARK.split(text)
        if sorted(int(p) for p in pieces[1::2]) != risky:
            # The template rewrote or repeated the text (rare): treat it whole, as before, and say so.
            log.warning("chat template transforms message text; special-token strings in it stay special")
            return None
        ids: list[int] = []
        for j, piece in enumerate(pieces):
            if j % 2 == 0:
                ids += self.encode(piece, add_special_tokens=False)
            else:
                ids += self.encode_text(str(messages[int(piece)]["content"]))
        return ids

    def encode_text(self, text: str) -> list[int]:
        """Token ids of `text` with special-token strings in it read as ordinary characters."""
        with self._lock:
            self.backend.encode_special_tokens = True
            try:
                return self.backend.encode(text, add_special_tokens=False).ids
            finally:
                self.backend.encode_special_tokens = False

    # --- helpers --------------------------------------------------------------------------------

    def _id_of(self, token: str | None) -> int | None:
        return None if token is None else self.backend.token_to_id(token)

    def _backend_adds(self, token_id: int | None, flag: str) -> bool:
        """Whether the backend's post-processor puts `token_id` first (BOS) or last (EOS)."""
        if token_id is None:
            return False
        ids = self.backend.encode("a", add_special_tokens=True).ids
        plain = self.backend.encode("a", add_special_tokens=False).ids
        edge = 0 if flag == "add_bos_token" else -1
        return len(ids) > len(plain) and ids[edge] == token_id

    def _find_eos_token_ids(self) -> set[int]:
        """EOS, generation_config's extra eos ids, and the special token that closes an assistant turn
        in the chat template (e.g. <|eot_id|> for Llama 3, <end_of_turn> for Gemma): a model stops
        after its reply by emitting that, even when the file's eos_token is another token."""
        ids = set(self.generation_eos_ids)
        if self.eos_token_id is not None:
            ids.add(self.eos_token_id)
        turn_end = self._turn_end_token()
        if turn_end is not None:
            ids.add(turn_end)
        return ids

    def _turn_end_token(self) -> int | None:
        probe = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": _PROBE_REPLY}]
        try:
            rendered = self.apply_chat_template(probe, add_generation_prompt=False)
        except ValueError:
            return None  # a template that rejects this conversation tells us nothing
        _, found, after = rendered.partition(_PROBE_REPLY)
        after = after.lstrip()
        if not found or not after:
            return None
        special = [t.content for t in self.backend.get_added_tokens_decoder().values() if t.special]
        closing = [token for token in special if after.startswith(token)]
        return self.backend.token_to_id(max(closing, key=len)) if closing else None


def _token_content(value: Any) -> str | None:
    """tokenizer_config.json writes a special token as a string or as an AddedToken dict."""
    if isinstance(value, Mapping):
        value = value.get("content")
    return value if isinstance(value, str) else None


def _templates_by_name(value: Any) -> dict[str, str]:
    """`chat_template` is a string, or a list of {"name", "template"} (e.g. "default", "tool_use")."""
    if isinstance(value, str):
        return {"default": value}
    if isinstance(value, list):
        return {item["name"]: item["template"] for item in value if isinstance(item, Mapping)}
    return {}


def _read_json(path: Path) -> dict[str, Any]:
    if not path.is_file():
        return {}
    return json.loads(path.read_text(encoding="utf-8"))
