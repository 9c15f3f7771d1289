"""`tokenmill cache`: what the cache folder holds, and `cache prune` to remove what nothing uses."""

from __future__ import annotations

import time
from pathlib import Path

import typer
from rich.table import Table

from tokenmill.cli.common import console, fail

cache_app = typer.Typer(
    invoke_without_command=True,
    help="The cache folder: dequantized weights, 4- and 8-bit codes, kernel builds.",
)

CACHE_DIR_HELP = "cache folder (default $XDG_CACHE_HOME/tokenmill or ~/.cache/tokenmill)"


def _scan(cache_dir: str | None):
    from tokenmill.paths import default_cache_dir
    from tokenmill.weights.cache_inventory import scan
    from tokenmill.weights.loader import CODES_FORMAT

    root = Path(cache_dir).expanduser() if cache_dir else default_cache_dir()
    return root, scan(root, _current_kernels(root), CODES_FORMAT)


def _current_kernels(root: Path) -> set[Path]:
    """The kernel build folders this install loads, every level, under `root`."""
    from tokenmill.kernels import build_dir
    from tokenmill.kernels.isa import all_levels
    from tokenmill.paths import default_cache_dir

    return {root / build_dir(lv).relative_to(default_cache_dir()) for lv in all_levels()}


def _size(n: int) -> str:
    for unit in ("B", "KB", "MB", "GB"):
        if n < 1000 or unit == "GB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000  # type: ignore[assignment]
    raise AssertionError


def _age(t: float) -> str:
    days = (time.time() - t) / 86400
    return f"{days * 24:.1f} h ago" if days < 1 else f"{days:.0f} d ago"


@cache_app.callback()
def cache_list(
    ctx: typer.Context,
    cache_dir: str | None = typer.Option(None, help=CACHE_DIR_HELP),
    sources: bool = typer.Option(
        False, "--sources", help="also list the files each weights entry was made from"
    ),
) -> None:
    """List the cache's entries: size, last use, and which are stale (`cache prune` removes those)."""
    if ctx.invoked_subcommand is not None:
        return
    root, entries = _scan(cache_dir)
    if not entries:
        console.print(f"{root}: empty")
        return
    table = Table("kind", "entry", "size", "last used", "state")
    for e in sorted(entries, key=lambda e: (e.kind, -e.size)):
        if e.stale:
            state = f"[yellow]stale[/yellow]: {e.stale}"
        elif e.kind == "weights":
            state = f"{len(e.sources)} source{'s' * (len(e.sources) != 1)}" if e.sources else "source unknown"
        else:
            state = "in use" if e.kind == "kernels" else ""
        if e.parts:
            state = "; ".join(filter(None, [state, f"{len(e.parts)} stale part{'s' * (len(e.parts) > 1)}"]))
        name = e.path.relative_to(root).as_posix()
        table.add_row(e.kind, name, _size(e.size), _age(e.last_used), state)
        if sources:
            for s in e.sources:
                table.add_row("", f"  {s}", "", "", "")
    table.columns[1].overflow = "fold"  # an entry's name whole, over lines if need be
    console.print(table)
    stale = [e for e in entries if e.stale]
    console.print(
        f"{root}: {_size(sum(e.size for e in entries))} in {len(entries)} entries; "
        f"stale: {_size(sum(e.size for e in stale))} in {len(stale)} (`tokenmill cache prune` removes them; "
        "`--older-than DAYS` also what has not been used for that long). "
        "Weights of unknown source were made before tokenmill recorded sources."
    )


@cache_app.command("prune")
def cache_prune(
    older_than: float | None = typer.Option(
        None, "--older-than", help="also remove any entry not used for this many days"
    ),
    dry_run: bool = typer.Option(False, "--dry-run", help="list what would go, remove nothing"),
    yes: bool = typer.Option(False, "--yes", "-y", help="do not ask"),
    cache_dir: str | None = typer.Option(None, help=CACHE_DIR_HELP),
) -> None:
    """Remove stale entries: weights whose sources are gone or changed, codes of an older format,
    kernel builds of other sources, memos of files that are gone. What goes is rebuilt when needed."""
    from tokenmill.weights.cache_inventory import prunable, remove, size_of

    if older_than is not None and older_than < 0:
        fail("--older-than must be at least 0 days")
    root, entries = _scan(cache_dir)
    paths = prunable(entries, older_than)
    if not paths:
        console.print(f"{root}: nothing to remove")
        return
    known = {e.path: e.size for e in entries}
    sizes = [known[p] if p in known else size_of(p) for p in paths]  # a stale part: measured here
    for p, n in zip(paths, sizes, strict=True):
        console.print(f"  {p.relative_to(root).as_posix()}  {_size(n)}")
    total = sum(sizes)
    if dry_run:
        console.print(f"would free {_size(total)} ({len(paths)} entries)")
        return
    if not yes and not typer.confirm(f"remove these {len(paths)} entries ({_size(total)})?"):
        raise typer.Exit(1)
    console.print(f"freed {_size(remove(paths))}")
