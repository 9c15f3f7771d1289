"""A reader for protobuf text format (Triton's config.pbtxt), keeping the line of every field.

The generic layer only parses: `name: value`, `name { ... }`, `name: [ ... ]`, repeated fields,
comments, quoted strings, numbers, enum identifiers. `decode` then checks the result against a
schema (tokenmill/triton/config.py) so that an unknown field, a wrong type or a field tokenmill does
not support is reported as `config.pbtxt:LINE: ...`.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any


class ConfigError(ValueError):
    pass


@dataclass
class Field:
    name: str
    value: Any  # scalar (str | int | float | bool | Enum name) or list[Field] for a message
    line: int
    is_message: bool = False


@dataclass
class Ident:
    """An unquoted identifier value: an enum name, or true/false."""

    text: str


_TOKEN = re.compile(
    r"""
    (?P<ws>[ \t\r]+) | (?P<nl>\n) | (?P<comment>\#[^\n]*)
  | (?P<string>"(?:[^"\\\n]|\\.)*"|'(?:[^'\\\n]|\\.)*')
  | (?P<number>[-+]?(?:\d+\.\d*|\.\d+|\d+)(?:[eE][-+]?\d+)?[fF]?(?![A-Za-z_]))
  | (?P<ident>[A-Za-z_][A-Za-z0-9_.]*)
  | (?P<sym>[{}\[\]:,;<>])
    """,
    re.VERBOSE,
)


def _tokens(text: str, source: str) -> list[tuple[str, str, int]]:
    out, line, pos = [], 1, 0
    while pos < len(text):
        m = _TOKEN.match(text, pos)
        if not m:
            raise ConfigError(f"{source}:{line}: cannot read {text[pos : pos + 20]!r}")
        kind = m.lastgroup
        if kind == "nl":
            line += 1
        elif kind not in ("ws", "comment"):
            out.append((kind, m.group(), line))
        pos = m.end()
    return out


def parse(text: str, source: str = "config.pbtxt") -> list[Field]:
    toks = _tokens(text, source)
    i = 0

    def peek() -> tuple[str, str, int] | None:
        return toks[i] if i < len(toks) else None

    def take(expect: str | None = None) -> tuple[str, str, int]:
        nonlocal i
        if i >= len(toks):
            last = toks[-1][2] if toks else 1
            raise ConfigError(
                f"{source}:{last}: unexpected end of file" + (f", expected {expect!r}" if expect else "")
            )
        t = toks[i]
        if expect is not None and t[1] != expect:
            raise ConfigError(f"{source}:{t[2]}: expected {expect!r}, found {t[1]!r}")
        i += 1
        return t

    def scalar() -> Any:
        kind, text_, line = take()
        if kind == "string":
            return bytes(text_[1:-1], "utf-8").decode("unicode_escape")
        if kind == "number":
            t = text_.rstrip("fF")
            return float(t) if any(c in t for c in ".eE") else int(t)
        if kind == "ident":
            return Ident(text_)
        raise ConfigError(f"{source}:{line}: expected a value, found {text_!r}")

    def message(close: str | None) -> list[Field]:
        fields: list[Field] = []
        while True:
            t = peek()
            if t is None:
                if close is not None:
                    raise ConfigError(f"{source}:{toks[-1][2]}: missing {close!r}")
                return fields
            if close is not None and t[1] == close:
                take()
                return fields
            kind, name, line = take()
            if kind != "ident":
                raise ConfigError(f"{source}:{line}: expected a field name, found {name!r}")
            nxt = peek()
            if nxt is not None and nxt[1] == ":":
                take()
                nxt = peek()
            if nxt is not None and nxt[1] in ("{", "<"):
                take()
                fields.append(Field(name, message("}" if nxt[1] == "{" else ">"), line, True))
            elif nxt is not None and nxt[1] == "[":
                take()
                while True:
                    t2 = peek()
                    if t2 is not None and t2[1] == "]":
                        take()
                        break
                    if t2 is not None and t2[1] in ("{", "<"):
                        take()
                        fields.append(Field(name, message("}" if t2[1] == "{" else ">"), t2[2], True))
                    else:
                        fields.append(Field(name, scalar(), t2[2] if t2 else line))
                    t3 = peek()
                    if t3 is not None and t3[1] == ",":
                        take()
            else:
                fields.append(Field(name, scalar(), line))
            t4 = peek()
            if t4 is not None and t4[1] in (",", ";"):
                take()

    return message(None)


# --- schema-checked decoding -------------------------------------------------------------------

# A schema maps a field name to (kind, repeated). kind: "string" | "int" | "float" | "bool" |
# ("enum", {names}) | a nested schema dict | "unsupported" (known to Triton, not to tokenmill).
Schema = dict[str, tuple[Any, bool]]


def decode(fields: list[Field], schema: Schema, source: str, path: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for f in fields:
        where = f"{path}.{f.name}" if path else f.name
        if f.name not in schema:
            raise ConfigError(f"{source}:{f.line}: unknown field '{where}'")
        kind, repeated = schema[f.name]
        if kind == "unsupported":
            raise ConfigError(f"{source}:{f.line}: field '{where}' is not supported by tokenmill")
        value = _convert(f, kind, source, where)
        if repeated:
            out.setdefault(f.name, []).append(value)
        else:
            if f.name in out:
                raise ConfigError(f"{source}:{f.line}: field '{where}' given twice")
            out[f.name] = value
    return out


def _convert(f: Field, kind: Any, source: str, where: str) -> Any:
    bad = f"{source}:{f.line}: field '{where}'"
    if isinstance(kind, dict):
        if not f.is_message:
            raise ConfigError(f"{bad} must be a message {{ ... }}")
        return decode(f.value, kind, source, where)
    if f.is_message:
        raise ConfigError(f"{bad} takes a value, not a message")
    v = f.value
    if kind == "string":
        if not isinstance(v, str):
            raise ConfigError(f"{bad} must be a quoted string")
        return v
    if kind == "int":
        if not isinstance(v, int):
            raise ConfigError(f"{bad} must be an integer")
        return v
    if kind == "float":
        if isinstance(v, bool) or not isinstance(v, int | float):
            raise ConfigError(f"{bad} must be a number")
        return float(v)
    if kind == "bool":
        if isinstance(v, Ident) and v.text in ("true", "false", "True", "False"):
            return v.text.lower() == "true"
        if isinstance(v, int) and v in (0, 1):
            return bool(v)
        raise ConfigError(f"{bad} must be true or false")
    if isinstance(kind, tuple) and kind[0] == "enum":
        if not isinstance(v, Ident) or v.text not in kind[1]:
            raise ConfigError(f"{bad}: {getattr(v, 'text', v)!r} is not one of {', '.join(sorted(kind[1]))}")
        return v.text
    raise AssertionError(kind)


# --- writing --------------------------------------------------------------------------------------

_INLINE_WIDTH = 100  # a message that fits on a line this long is written on one, as the examples are


def format_config(values: dict[str, Any], schema: Schema, header: str = "") -> str:
    """Protobuf text for `values` as `decode` returns them (config.pbtxt's field names), in the style of
    the example repository: fields in the schema's order, small messages on one line, lists in [ ].
    `header` becomes leading `#` comment lines. `parse` then `decode` give `values` back."""
    lines = [f"# {line}".rstrip() for line in header.splitlines()]
    lines += _fields(values, schema, "")
    return "\n".join(lines) + "\n"


def _fields(values: dict[str, Any], schema: Schema, indent: str) -> list[str]:
    lines: list[str] = []
    for name in sorted(values, key=lambda n: list(schema).index(n) if n in schema else len(schema)):
        if name not in schema:
            raise ValueError(f"field {name!r} is not in the schema")
        kind, repeated = schema[name]
        value = values[name]
        if not isinstance(kind, dict):
            text = (
                "[ " + ", ".join(_scalar(v, kind) for v in value) + " ]" if repeated else _scalar(value, kind)
            )
            lines.append(f"{indent}{name}: {text}")
        elif not repeated:
            lines += _message(name, value, kind, indent)
        else:
            inline = [_inline(v, kind) for v in value]
            one = f"{indent}{name} [ {', '.join(inline)} ]"
            if len(one) <= _INLINE_WIDTH:
                lines.append(one)
                continue
            lines.append(f"{indent}{name} [")
            for i, v in enumerate(value):
                comma = "," if i < len(value) - 1 else ""
                if len(indent) + 2 + len(inline[i]) + 1 <= _INLINE_WIDTH:
                    lines.append(f"{indent}  {inline[i]}{comma}")
                else:
                    lines += [f"{indent}  {{", *_fields(v, kind, indent + "    "), f"{indent}  }}{comma}"]
            lines.append(f"{indent}]")
    return lines


def _message(name: str, value: dict[str, Any], kind: Schema, indent: str) -> list[str]:
    one = f"{indent}{name} {_inline(value, kind)}"
    if len(one) <= _INLINE_WIDTH:
        return [one]
    return [f"{indent}{name} {{", *_fields(value, kind, indent + "  "), f"{indent}}}"]


def _inline(value: dict[str, Any], kind: Schema) -> str:
    inner = " ".join(line.strip() for line in _fields(value, kind, ""))
    return f"{{ {inner} }}" if inner else "{ }"


def _scalar(v: Any, kind: Any) -> str:
    if kind == "string":
        escaped = str(v).replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n").replace("\t", "\\t")
        return f'"{escaped}"'
    if kind == "bool":
        return "true" if v else "false"
    if kind == "int":
        return str(int(v))
    if kind == "float":
        f = float(v)
        if f != f or f in (float("inf"), float("-inf")):
            raise ValueError(f"{f} cannot be written in a config.pbtxt")
        return repr(f)
    if isinstance(kind, tuple) and kind[0] == "enum":
        return str(v)
    raise ValueError(f"a field of kind {kind!r} cannot be written")
