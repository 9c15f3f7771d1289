"""How help reads: flags without a type label, and long commands that open with their common options.

A command built with `LayeredCommand` shows, under `--help`, only its first panel ("Options": the flags
most people need) and one line naming the other panels; `--help-all` shows every panel. Which options
are common is decided where the command is built, by leaving their `rich_help_panel` unset.
"""

from __future__ import annotations

import copy
from typing import Any

import typer
from typer.core import TyperCommand, TyperOption

HELP_ALL_KEY = "tokenmill.help_all"  # in ctx.meta: --help-all asked for every panel
DEFAULT_PANEL = "Options"  # typer's title for options without a panel of their own


def _flag_type_label(self: TyperOption, ctx: Any) -> str | None:
    """A flag takes no value, so it gets no type label: typer would print `<bool>` beside `--help` and
    beside every `--x/--no-x`, which reads as if they wanted an argument."""
    if self.metavar is None and (self.is_flag or self.count):
        return None
    return _typed_label(self, ctx)


# Once, for every command of the process (sub-apps included): typer has no setting for this, and each
# option object is built inside typer, out of our reach. The test suite checks the result.
_typed_label = TyperOption.display_type_rich
TyperOption.display_type_rich = _flag_type_label  # type: ignore[method-assign]


def _show_all(ctx: typer.Context, value: bool) -> None:
    if value and not ctx.resilient_parsing:
        ctx.meta[HELP_ALL_KEY] = True
        typer.echo(ctx.get_help(), color=ctx.color)
        raise typer.Exit()


HELP_ALL_OPTION = typer.Option(
    False, "--help-all", is_eager=True, expose_value=False, callback=_show_all,
    help="Show every option, grouped, and exit.",
)  # fmt: skip


def panel_of(param: Any) -> str:
    return getattr(param, "rich_help_panel", None) or DEFAULT_PANEL


class LayeredCommand(TyperCommand):
    """A command whose `--help` shows the default panel and a line about the rest (see the module)."""

    def format_help(self, ctx: Any, formatter: Any) -> None:
        if ctx.meta.get(HELP_ALL_KEY):
            return super().format_help(ctx, formatter)
        rest = [p for p in self.params if panel_of(p) != DEFAULT_PANEL and not getattr(p, "hidden", False)]
        if not rest:
            return super().format_help(ctx, formatter)
        panels = list(dict.fromkeys(panel_of(p) for p in rest))
        short = copy.copy(self)  # the same command, minus the other panels: parsing is left untouched
        short.params = [p for p in self.params if p not in rest]
        short.epilog = (
            f"{len(rest)} more options in {', '.join(panels)}: run `{ctx.command_path} --help-all`."
        )
        return TyperCommand.format_help(short, ctx, formatter)
