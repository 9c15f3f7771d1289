"""Write the generated reference pages under docs/reference/, or check that the committed ones are current.

    python scripts/docs_reference.py          # write cli.md, config.md and http-api.md
    python scripts/docs_reference.py --check  # exit 1, naming the stale pages, if a page would change

The pages come from the code itself (the typer app, the config dataclasses, the server's OpenAPI
document), so they cannot drift from it; the test suite runs the check. The output is deterministic:
no dates, no paths of this machine, and defaults that depend on the machine are left to their help text.
"""

from __future__ import annotations

import argparse
import dataclasses
import re
import sys
import typing
from collections.abc import Callable, Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
OUT = ROOT / "docs" / "reference"
if str(ROOT) not in sys.path:  # run from a checkout without an installed package
    sys.path.insert(0, str(ROOT))

COMMAND = "python scripts/docs_reference.py"


def _header(source: str) -> str:
    return f"<!-- Generated from {source} by `{COMMAND}`: do not edit; run it again after a change. -->\n"


# -- Markdown ---------------------------------------------------------------------------------------
def _escape(text: str) -> str:
    """Plain text for a Markdown table cell: characters that would start markup, HTML or a new column
    are escaped, and line breaks become spaces."""
    text = re.sub(r"\s+", " ", text)  # not split(): the spaces around a code span must stay
    text = text.replace("\\", "\\\\").replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;")
    for ch in "*_[]|#":
        text = text.replace(ch, "\\" + ch)
    return text


def md(text: str | None) -> str:
    """Help text as Markdown: its `code` spans kept, everything else escaped."""
    if not text:
        return ""
    parts = text.split("`")
    if len(parts) % 2 == 0:  # an unpaired backtick: no code spans at all
        return _escape(text)
    out = []
    for i, part in enumerate(parts):
        # a pipe would end the table cell even inside a code span: such a span is left as plain text
        code = i % 2 == 1 and "|" not in part and part.strip() != ""
        out.append(f"`{' '.join(part.split())}`" if code else _escape(part))
    return "".join(out)


def code(value: str) -> str:
    """A literal value in a table cell."""
    if value == "" or "`" in value or "|" in value:
        return _escape(value) if value else '`""`'
    return f"`{value}`"


def table(header: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    return "\n".join(lines) + "\n"


# -- the command line -------------------------------------------------------------------------------
def _commands(cmd: Any, ctx: Any) -> Iterator[tuple[Any, Any]]:
    """Every command under `cmd`, depth first, in the order `--help` lists them."""
    yield cmd, ctx
    if not hasattr(cmd, "list_commands"):
        return
    import typer

    for name in cmd.list_commands(ctx):
        sub = cmd.get_command(ctx, name)
        if sub is not None and not sub.hidden:
            yield from _commands(sub, typer.Context(sub, info_name=name, parent=ctx))


def _option_default(param: Any) -> str:
    if param.required:
        return "required"
    value = param.default
    if getattr(param, "is_flag", False):
        if param.secondary_opts:  # --x/--no-x: the default is one of the two
            return code(param.opts[0] if value else param.secondary_opts[0])
        return ""  # a plain flag is off unless given
    if value is None or value == [] or value == ():
        return ""
    if isinstance(value, list | tuple):
        return ", ".join(code(str(v)) for v in value)
    return code(str(value))


def _option_type(param: Any, ctx: Any) -> str:
    if getattr(param, "is_flag", False) or getattr(param, "count", False):
        return "flag"
    label = param.display_type(ctx).strip("<>")
    if getattr(param, "multiple", False):  # typer calls it list[T]: one T per use of the flag
        label = label.removeprefix("list[").removesuffix("]") + ", repeatable"
    return md(label)


def _option_row(param: Any, ctx: Any) -> list[str]:
    if param.param_type_name == "argument":
        name = code(param.name.upper())
    else:
        name = " / ".join(code(o) for o in (*param.opts, *param.secondary_opts))
    help_text = md(getattr(param, "help", None) or "")
    if getattr(param, "envvar", None):
        help_text += f" (environment: {code(str(param.envvar))})"
    return [name, _option_type(param, ctx), _option_default(param), help_text.strip()]


def cli_page() -> str:
    import typer

    from tokenmill.cli.help_layout import LayeredCommand, panel_of
    from tokenmill.cli.main import app

    root = typer.main.get_command(app)
    out = [_header("the typer app `tokenmill.cli.main:app`"), "# Command line\n"]
    out.append(
        "Every `tokenmill` command and its options, as `--help` lists them. Commands with many options "
        "(`serve`, `worker`) show their common ones under `--help` and the rest, grouped, under "
        "`--help-all`; the groups below are the same.\n"
    )
    for cmd, ctx in _commands(root, typer.Context(root, info_name="tokenmill")):
        path = ctx.command_path
        out.append(f"## {path}\n")
        if cmd.help:
            for paragraph in cmd.help.strip().split("\n\n"):
                out.append(md(paragraph) + "\n")
        # typer writes an argument as {name} in the usage line; the table below calls it NAME
        pieces = [p.strip("{}").upper() if p.startswith("{") else p for p in cmd.collect_usage_pieces(ctx)]
        usage = " ".join([path, *pieces])
        out.append(f"Usage: `{usage}`\n")
        if hasattr(cmd, "list_commands"):
            subs = [(n, cmd.get_command(ctx, n)) for n in cmd.list_commands(ctx)]
            rows = [[code(f"{path} {n}"), md(c.get_short_help_str(limit=300))] for n, c in subs if c]
            if rows:
                out.append(table(["Command", "What it does"], rows))
        panels: dict[str, list[Any]] = {}
        for param in cmd.get_params(ctx):
            if getattr(param, "hidden", False):
                continue
            title = "Arguments" if param.param_type_name == "argument" else panel_of(param)
            panels.setdefault(title, []).append(param)
        for title, params in sorted(panels.items(), key=lambda kv: kv[0] != "Arguments"):
            note = " (`--help` lists these; `--help-all` the groups below)" if (
                isinstance(cmd, LayeredCommand) and title == "Options"
            ) else ""  # fmt: skip
            out.append(f"### {title}{note}\n")
            header = ["Argument" if title == "Arguments" else "Option", "Type", "Default", "Description"]
            out.append(table(header, [_option_row(p, ctx) for p in params]))
    return "\n".join(out)


# -- the configuration tree -------------------------------------------------------------------------
def _type_name(hint: Any) -> str:
    if isinstance(hint, type) and not typing.get_args(hint):
        return hint.__name__
    return str(hint).replace("typing.", "").replace("NoneType", "None")


def _field_default(f: dataclasses.Field) -> Any:
    if f.default_factory is not dataclasses.MISSING:
        return f.default_factory()
    return f.default


def _yaml_value(value: Any) -> str:
    import yaml

    return yaml.safe_dump(value, default_flow_style=True).strip().removesuffix("...").strip()


def _sections(cls: type, path: tuple[str, ...] = ()) -> Iterator[tuple[tuple[str, ...], type]]:
    yield path, cls
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        if dataclasses.is_dataclass(hints[f.name]):
            yield from _sections(hints[f.name], (*path, f.name))


def _own_doc(cls: type) -> str:
    """The class's docstring, not the signature dataclasses write when it has none."""
    doc = cls.__doc__ or ""
    return "" if doc.startswith(cls.__name__ + "(") else " ".join(doc.split())


def config_page() -> str:
    import yaml

    from tokenmill.cli.config_options import SERVER_SECTIONS
    from tokenmill.server.config import ServerConfig

    titles = {s.cls: s.title for s in SERVER_SECTIONS}
    out = [_header("the config dataclasses (`tokenmill/config.py`, `tokenmill/server/config.py`)")]
    out.append("# Configuration\n")
    out.append(
        "`tokenmill serve` and `tokenmill worker` take their settings as flags or as a YAML file, "
        "`--config FILE.yaml`, holding the same tree as nested mappings; a flag given on the command "
        "line wins over the file. Unknown keys are errors that name them. `serve` reads the whole tree "
        "below; `worker` runs one engine and reads the `engine` section's tree at the top level of its "
        "file (`model:`, `cache:`, ... without `engine:`).\n"
    )
    out.append(
        "Each setting below gives its key in the file, its flag, its type and default (unset: the "
        "help says what happens), and its help.\n"
    )
    out.append(
        "```yaml\n# serve.yaml: tokenmill serve --config serve.yaml\nport: 8000\nengine:\n"
        "  model: smollm2-135m\n  quantization: int4\n  cache:\n    kv_cache_memory_gb: 4\n"
        "  scheduler:\n    max_num_seqs: 64\nfleet:\n  router: kv\n```\n"
    )
    for path, cls in _sections(ServerConfig):
        key = ".".join(path) or "top level"
        out.append(f"## {titles.get(cls, cls.__name__)}: `{key}`\n" if path else f"## {titles[cls]}\n")
        if not path:
            out.append("Keys at the top level of the file.\n")
        if doc := _own_doc(cls):
            out.append(md(doc) + "\n")
        hints = typing.get_type_hints(cls)
        rows = []
        for f in dataclasses.fields(cls):
            if dataclasses.is_dataclass(hints[f.name]):
                continue
            flag = "--" + (f.metadata.get("flag") or f.name).replace("_", "-")
            if hints[f.name] is bool:
                flag += f" / --no-{flag[2:]}"
            flag += "".join(f" / --{a}" for a in f.metadata.get("aliases", ()))
            default = _field_default(f)
            shown = "unset" if default is None else code(_yaml_value(default))
            help_text = md(f.metadata.get("help", ""))
            if f.metadata.get("envvar"):
                help_text += f" (environment: {code(f.metadata['envvar'])})"
            rows.append([code(f.name), code(flag), md(_type_name(hints[f.name])), shown, help_text])
        out.append(table(["Key", "Flag", "Type", "Default", "Description"], rows))
    out.append("## Every key with its default\n")
    out.append("The whole tree `serve` reads, as a file that changes nothing:\n")
    tree = yaml.safe_dump(dataclasses.asdict(ServerConfig()), sort_keys=False, default_flow_style=False)
    out.append(f"```yaml\n{tree}```\n")
    return "\n".join(out)


# -- the HTTP API -----------------------------------------------------------------------------------
def openapi_document() -> dict[str, Any]:
    """The server's OpenAPI document, built without an engine or a model.

    build_app only wires routes at this point: the frontend is read when a request arrives, so a stand-in
    whose `client` is an empty object is enough for ServerState (the metrics keep the client for later
    scrapes), with a tokenizer that has no chat template (the tool-call format is read from it). A
    stand-in repository likewise adds the KServe v2 routes a `--model-repository` brings.
    """
    from tokenmill.server.app import build_app
    from tokenmill.server.config import ServerConfig

    stand_in = SimpleNamespace(client=SimpleNamespace(info={}), tokenizer=SimpleNamespace(chat_template=None))
    app = build_app(stand_in, ServerConfig(), repository=SimpleNamespace())  # type: ignore[arg-type]
    return app.openapi()


def _schema_type(s: dict[str, Any]) -> str:
    if "$ref" in s:
        return s["$ref"].rsplit("/", 1)[-1]
    if "const" in s:
        return f"`{s['const']}`"
    if "enum" in s:
        return " or ".join(f"`{v}`" for v in s["enum"])
    for key in ("anyOf", "oneOf"):
        if key in s:
            return " or ".join(dict.fromkeys(_schema_type(x) for x in s[key]))
    kind = s.get("type")
    if kind == "array":
        return f"array of {_schema_type(s.get('items', {}))}" if s.get("items") else "array"
    if kind == "null":
        return "null"
    if kind == "object" and "additionalProperties" in s and isinstance(s["additionalProperties"], dict):
        return f"object of {_schema_type(s['additionalProperties'])}"
    return str(kind) if kind else "any"


def _body_schema(op: dict[str, Any]) -> dict[str, Any]:
    return op.get("requestBody", {}).get("content", {}).get("application/json", {}).get("schema", {})


def _body_name(op: dict[str, Any]) -> str:
    body = op.get("requestBody")
    if not body:
        return ""
    schema = _body_schema(op)
    if "$ref" in schema:
        name = schema["$ref"].rsplit("/", 1)[-1]
    else:
        keys = ", ".join(code(k) for k in schema.get("properties", {}))
        name = f"object ({keys})" if keys else "object"
    return name + ("" if body.get("required") else " (optional)")


def _fields(schema: dict[str, Any]) -> str:
    required = set(schema.get("required", []))
    props = sorted(schema.get("properties", {}).items())
    described = any(prop.get("description") for _, prop in props)  # else no empty column
    rows = []
    for name, prop in props:
        default = code(_yaml_value(prop["default"])) if "default" in prop else ""
        row = [code(name), md(_schema_type(prop)), "yes" if name in required else "", default]
        rows.append([*row, md(prop.get("description", ""))] if described else row)
    header = ["Field", "Type", "Required", "Default"]
    return table([*header, "Description"] if described else header, rows)


def http_page() -> str:
    doc = openapi_document()
    out = [_header("the server's OpenAPI document (`tokenmill.server.app.build_app`)"), "# HTTP API\n"]
    out.append(
        "The routes `tokenmill serve` answers, from the same OpenAPI document a running server gives at "
        "`/openapi.json` (and shows at `/docs`). The KServe v2 routes under `/v2` are there only with "
        "`--model-repository`. With `--api-key`, every route asks for `Authorization: Bearer KEY`.\n"
    )
    openai, kserve = "OpenAI API and server", "KServe v2 (with `--model-repository`)"
    groups: dict[str, list[list[str]]] = {openai: [], kserve: []}
    codes: dict[str, set[str]] = {}
    for path, ops in doc["paths"].items():
        for method, op in ops.items():
            group = kserve if path.startswith("/v2") else openai
            responses = op.get("responses", {})
            for status, answer in responses.items():
                codes.setdefault(status, set()).add(answer.get("description", ""))
            row = [
                code(method.upper()),
                code(path),
                md(op.get("summary", "")),
                md(_body_name(op)),
                ", ".join(sorted(responses)),
            ]
            groups[group].append(row)
    for title, rows in groups.items():
        out.append(f"## {title}\n")
        out.append(table(["Method", "Path", "Summary", "Request body", "Status codes"], rows))
    schemas = doc.get("components", {}).get("schemas", {})
    refs = {_body_schema(op).get("$ref") for ops in doc["paths"].values() for op in ops.values()}
    bodies = sorted(ref.rsplit("/", 1)[-1] for ref in refs if ref)
    out.append("## Request bodies\n")
    out.append("The top-level fields of each JSON body; nested types are named as in `/openapi.json`.\n")
    for name in bodies:
        out.append(f"### {name}\n")
        out.append(_fields(schemas[name]))
    out.append("## Status codes\n")
    # one meaning a line: the descriptions have semicolons of their own
    rows = [[code(s), "<br>".join(md(d) for d in sorted(codes[s]) if d)] for s in sorted(codes)]
    out.append(table(["Status", "Meaning"], rows))
    return "\n".join(out)


PAGES: dict[str, Callable[[], str]] = {"cli.md": cli_page, "config.md": config_page, "http-api.md": http_page}


def stale_pages() -> list[str]:
    """The pages whose committed text differs from what this script writes (missing ones included)."""
    stale = []
    for name, render in PAGES.items():
        page = OUT / name
        if not page.is_file() or page.read_text(encoding="utf-8") != render():
            stale.append(f"docs/reference/{name}")
    return stale


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="exit 1 if a committed page is stale")
    args = parser.parse_args(argv)
    if args.check:
        stale = stale_pages()
        if stale:
            print(f"stale generated reference: {', '.join(stale)}; run `{COMMAND}`", file=sys.stderr)
            return 1
        return 0
    OUT.mkdir(parents=True, exist_ok=True)
    for name, render in PAGES.items():
        (OUT / name).write_text(render(), encoding="utf-8")
        print(f"wrote docs/reference/{name}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
