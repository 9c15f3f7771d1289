"""What every sub-command shares: the consoles and the one-line error exit."""

from __future__ import annotations

from typing import NoReturn

import typer
from rich.console import Console

console = Console()
err = Console(stderr=True, soft_wrap=True)  # one error, one line: never wrapped


def fail(message: str) -> NoReturn:
    """One clear line on stderr and exit code 2, never a traceback."""
    err.print(f"[red]error:[/red] {message}", highlight=False)
    raise typer.Exit(2)
