"""Rendering a model's Jinja2 chat template the way Hugging Face transformers does.

Templates come from model files, so they run in Jinja2's immutable sandbox (no attribute tricks, no
mutation of the objects passed in). The environment mirrors transformers': `trim_blocks` and
`lstrip_blocks`, the `loopcontrols` extension, a `{% generation %}` block (rendered as its body),
the `raise_exception` and `strftime_now` globals and a `tojson` filter that takes `indent`,
`ensure_ascii`, `separators` and `sort_keys`.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from datetime import datetime
from functools import lru_cache
from typing import Any

import jinja2
from jinja2.ext import Extension, loopcontrols
from jinja2.sandbox import ImmutableSandboxedEnvironment

# Used when a model ships no template: ChatML (`<|im_start|>role\ncontent<|im_end|>\n` per message),
# the most widespread format and the one SmolLM2, Qwen and many fine-tunes use.
DEFAULT_CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


class ChatTemplateError(ValueError):
    """A chat template failed to compile or render (including a template's own raise_exception)."""


def render_chat_template(
    template: str | None,
    messages: Sequence[Mapping[str, Any]],
    add_generation_prompt: bool = False,
    bos_token: str | None = None,
    eos_token: str | None = None,
    **kwargs: Any,
) -> str:
    """Render `messages` with a Jinja2 chat template and return the prompt text.

    `template` None means the model has none: `DEFAULT_CHAT_TEMPLATE` (ChatML) is used. The template
    sees `messages`, `add_generation_prompt`, `bos_token` and `eos_token` (left undefined when None,
    so they render as ""), `tools` and `documents` (None unless given) and any other keyword argument.
    Raises ChatTemplateError, with a one-line message, if the template is invalid or fails.
    """
    compiled = _compile(template if template is not None else DEFAULT_CHAT_TEMPLATE)
    variables: dict[str, Any] = {"tools": None, "documents": None, **kwargs}
    variables.update(messages=[dict(m) for m in messages], add_generation_prompt=add_generation_prompt)
    if bos_token is not None:
        variables["bos_token"] = bos_token
    if eos_token is not None:
        variables["eos_token"] = eos_token
    try:
        return compiled.render(**variables)
    except ChatTemplateError:
        raise
    except jinja2.TemplateError as exc:
        raise ChatTemplateError(_one_line(f"chat template failed: {_describe(exc)}")) from exc
    except Exception as exc:  # a template can also trip ordinary Python errors (e.g. None + str)
        raise ChatTemplateError(_one_line(f"chat template failed: {type(exc).__name__}: {exc}")) from exc


class _GenerationBlock(Extension):
    """`{% generation %}...{% endgeneration %}` marks assistant text for training masks; when
    rendering a prompt it is just its body. Without this, templates that use it fail to compile."""

    tags = {"generation"}

    def parse(self, parser: jinja2.parser.Parser) -> jinja2.nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.Scope(body, lineno=lineno)


def _raise_exception(message: str) -> None:
    raise ChatTemplateError(_one_line(f"chat template raised: {message}"))


def _tojson(
    value: Any,
    ensure_ascii: bool = False,
    indent: int | None = None,
    separators: tuple[str, str] | None = None,
    sort_keys: bool = False,
) -> str:
    # Unlike Jinja's built-in tojson, no HTML escaping: the output is a prompt, not a web page.
    return json.dumps(
        value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


def _strftime_now(format: str) -> str:
    return datetime.now().strftime(format)


@lru_cache(maxsize=32)
def _compile(template: str) -> jinja2.Template:
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols, _GenerationBlock]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    try:
        return env.from_string(template)
    except jinja2.TemplateSyntaxError as exc:
        raise ChatTemplateError(_one_line(f"chat template is invalid: {_describe(exc)}")) from exc


def _describe(exc: jinja2.TemplateError) -> str:
    lineno = getattr(exc, "lineno", None)
    where = f" (line {lineno})" if lineno else ""
    return f"{type(exc).__name__}{where}: {exc.message or exc}"


def _one_line(text: str) -> str:
    return " ".join(text.split())
