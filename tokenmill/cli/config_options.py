"""Command-line flags generated from the config dataclasses, and the config tree built from them.

Each field of a section becomes `--field-name` (or its `flag`), typed and with its help, in a help
panel named for the section; the few a command names as common go first, in the panel `--help` shows
(cli/help_layout.py), and the rest wait for `--help-all`. `--config FILE.yaml` gives the same tree as
nested mappings (the dataclasses' own field names); flags given on the command line win over the file.
"""

from __future__ import annotations

import dataclasses
import inspect
import typing
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import typer

from tokenmill.cli.help_layout import HELP_ALL_OPTION, LayeredCommand
from tokenmill.config import (
    CacheConfig,
    EngineConfig,
    KVEventsConfig,
    KVOffloadConfig,
    KVTransferConfig,
    LoRAConfig,
    ParallelConfig,
    SchedulerConfig,
    SpeculativeConfig,
)
from tokenmill.server.config import FleetConfig, ServerConfig


@dataclass(frozen=True)
class Section:
    title: str
    cls: type
    path: tuple[str, ...]  # attributes from the root config to this section's object


ENGINE_SECTIONS = [
    Section("Model and engine", EngineConfig, ()),
    Section("Scheduler", SchedulerConfig, ("scheduler",)),
    Section("KV cache", CacheConfig, ("cache",)),
    Section("Parallelism", ParallelConfig, ("parallel",)),
    Section("KV events", KVEventsConfig, ("kv_events",)),
    Section("KV offload", KVOffloadConfig, ("offload",)),
    Section("KV transfer (disaggregation)", KVTransferConfig, ("kv_transfer",)),
    Section("Speculative decoding", SpeculativeConfig, ("speculative",)),
    Section("LoRA adapters", LoRAConfig, ("lora",)),
]
SERVER_SECTIONS = [
    Section("Server", ServerConfig, ()),
    Section("Fleet and router", FleetConfig, ("fleet",)),
    *(Section(s.title, s.cls, ("engine", *s.path)) for s in ENGINE_SECTIONS),
]


@dataclass(frozen=True)
class _Flag:
    param: str  # the Python parameter name, unique in the command
    path: tuple[str, ...]  # where the value goes in the tree
    parameter: inspect.Parameter
    name: str  # the flag without its dashes


def _flags(sections: list[Section], common: tuple[str, ...] = ()) -> list[_Flag]:
    """The sections' flags: those named in `common` (flag names without dashes) first, in that order and
    in the default panel; the others in their sections' panels."""
    flags = []
    for sec in sections:
        hints = typing.get_type_hints(sec.cls)
        for f in dataclasses.fields(sec.cls):
            if dataclasses.is_dataclass(hints[f.name]):
                continue  # a nested section: its fields are flags of their own
            name = (f.metadata.get("flag") or f.name).replace("_", "-")
            default = f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default
            decl = f"--{name}/--no-{name}" if hints[f.name] is bool else f"--{name}"
            aliases = [f"--{a}" for a in f.metadata.get("aliases", ())]  # other names of a non-bool flag
            opt = typer.Option(
                default, decl, *aliases, help=f.metadata.get("help", ""), envvar=f.metadata.get("envvar"),
                rich_help_panel=None if name in common else sec.title,
                show_default=default is not None and default != [],
            )  # fmt: skip
            param = "__".join((*sec.path, f.name))
            kind = inspect.Parameter.KEYWORD_ONLY
            p = inspect.Parameter(param, kind, default=opt, annotation=hints[f.name])
            flags.append(_Flag(param, (*sec.path, f.name), p, name))
    order = {name: i for i, name in enumerate(common)}
    unknown = set(common) - {f.name for f in flags}
    if unknown:
        raise ValueError(f"common flags that no section has: {', '.join(sorted(unknown))}")
    # sorted() is stable: the other flags keep the sections' order
    return sorted(flags, key=lambda f: order.get(f.name, len(order)))


def tree_from_mapping(cls: type, data: Any, where: str = "") -> Any:
    """A config dataclass from nested mappings; unknown keys are errors that name them."""
    if not isinstance(data, dict):
        raise ValueError(f"{where or 'the config'} must be a mapping, got {type(data).__name__}")
    hints = typing.get_type_hints(cls)
    names = {f.name for f in dataclasses.fields(cls)}
    kwargs = {}
    for key, value in data.items():
        if key not in names:
            raise ValueError(f"unknown setting {where + key!r}; known here: {', '.join(sorted(names))}")
        if dataclasses.is_dataclass(hints[key]):
            value = tree_from_mapping(hints[key], value, f"{where}{key}.")
        kwargs[key] = value
    return cls(**kwargs)


def config_command(
    app: typer.Typer,
    name: str,
    root: type,
    sections: list[Section],
    body: Callable[..., None],
    extra: list[inspect.Parameter] = (),  # type: ignore[assignment]
    help: str | None = None,
    common: tuple[str, ...] = (),
) -> None:
    """Register `name`: its flags are the sections' fields plus `extra`; `body(config, **extra)` runs.
    `extra` and the `common` flags make up what `--help` shows; `--help-all` shows the sections too."""
    flags = _flags(sections, common)
    n_common = sum(f.name in common for f in flags)
    config_opt = typer.Option(None, "--config", help="YAML file with the config tree (flags given win)")

    # help_all: typer passes every parameter of the signature, even one that does not expose its value
    def command(ctx: typer.Context, config: Path | None, help_all: bool = False, **values: Any) -> None:
        try:
            data = {} if config is None else _read_yaml(config)
            tree = tree_from_mapping(root, data)
        except (OSError, ValueError, TypeError) as e:
            from tokenmill.cli.common import fail

            fail(f"--config {config}: {e}")
        for f in flags:
            # A flag the user gave beats the file; a default never overrides what the file says.
            # By name: typer and click may each have their own ParameterSource enum.
            src = ctx.get_parameter_source(f.param)
            if config is None or src is None or src.name != "DEFAULT":
                obj = tree
                for attr in f.path[:-1]:
                    obj = getattr(obj, attr)
                setattr(obj, f.path[-1], values.pop(f.param))
            else:
                values.pop(f.param)
        try:
            _check(tree)
        except ValueError as e:
            from tokenmill.cli.common import fail

            fail(str(e))
        body(tree, **values)

    kind = inspect.Parameter.KEYWORD_ONLY
    command.__signature__ = inspect.Signature(  # type: ignore[attr-defined]
        [
            inspect.Parameter("ctx", inspect.Parameter.POSITIONAL_OR_KEYWORD, annotation=typer.Context),
            *extra,
            *(f.parameter for f in flags[:n_common]),
            inspect.Parameter("config", kind, default=config_opt, annotation=Path | None),
            inspect.Parameter("help_all", kind, default=HELP_ALL_OPTION, annotation=bool),
            *(f.parameter for f in flags[n_common:]),
        ]
    )
    command.__doc__ = _one_line_paragraphs(help or body.__doc__ or "")
    app.command(name, cls=LayeredCommand)(command)


def _one_line_paragraphs(text: str) -> str:
    """typer's rich help keeps a docstring's line breaks after the first paragraph, which then show as
    ragged lines: each paragraph becomes one line, for the terminal to wrap."""
    paragraphs = inspect.cleandoc(text).split("\n\n")
    return "\n\n".join(" ".join(p.split()) for p in paragraphs)


def _read_yaml(path: Path) -> dict:
    import yaml

    data = yaml.safe_load(path.read_text())
    return {} if data is None else data


def _check(obj: Any) -> None:
    """Run every section's own checks (__post_init__) again: flags were set after construction."""
    if not dataclasses.is_dataclass(obj):
        return
    post = getattr(obj, "__post_init__", None)
    if post is not None:
        post()
    for f in dataclasses.fields(obj):
        _check(getattr(obj, f.name))
