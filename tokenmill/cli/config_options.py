"""Command-line flags generated from the config dataclasses, and the config tree built from them.

Each field of a section becomes `--field-name` (or its `flag`), typed and with its help, in a help
panel named for the section. `--config FILE.yaml` gives the same tree as nested mappings (the
dataclasses' own field names); flags given on the command line win over the file.
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

from tokenmill.config import (
    CacheConfig,
    EngineConfig,
    KVEventsConfig,
    KVOffloadConfig,
    KVTransferConfig,
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


def _flags(sections: list[Section]) -> list[_Flag]:
    flags = []
    for sec in sections:
        hints = typing.get_type_hints(sec.cls)
        for f in dataclasses.fields(sec.cls):
            if dataclasses.is_dataclass(hints[f.name]):
                continue  # a nested section: its fields are flags of their own
            name = (f.metadata.get("flag") or f.name).replace("_", "-")
            default = f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default
            decl = f"--{name}/--no-{name}" if hints[f.name] is bool else f"--{name}"
            opt = typer.Option(
                default, decl, help=f.metadata.get("help", ""), envvar=f.metadata.get("envvar"),
                rich_help_panel=sec.title, show_default=default is not None and default != [],
            )  # fmt: skip
            param = "__".join((*sec.path, f.name))
            kind = inspect.Parameter.KEYWORD_ONLY
            p = inspect.Parameter(param, kind, default=opt, annotation=hints[f.name])
            flags.append(_Flag(param, (*sec.path, f.name), p))
    return flags


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
) -> None:
    """Register `name`: its flags are the sections' fields plus `extra`; `body(config, **extra)` runs."""
    flags = _flags(sections)
    config_opt = typer.Option(None, "--config", help="YAML file with the config tree (flags given win)")

    def command(ctx: typer.Context, config: Path | None, **values: Any) -> None:
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
            inspect.Parameter("config", kind, default=config_opt, annotation=Path | None),
            *extra,
            *(f.parameter for f in flags),
        ]
    )
    command.__doc__ = help or body.__doc__
    app.command(name)(command)


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
