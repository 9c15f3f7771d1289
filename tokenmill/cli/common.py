"""What every sub-command shares: the consoles, progress of long work and the one-line error exit."""

from __future__ import annotations

import time
from dataclasses import dataclass
from types import TracebackType
from typing import NoReturn

import typer
from rich.console import Console, ConsoleDimensions
from rich.markup import escape
from rich.progress import BarColumn, Progress, ProgressColumn, Task, TaskID, TextColumn, TimeElapsedColumn
from rich.text import Text

# Width when stdout is not a terminal and COLUMNS is unset: rich would assume 80 columns and cut wide
# tables' cells to "lev…" and "TT…"; a pipe, a file or a parent process wants them whole.
UNBOUNDED_WIDTH = 100_000


class _Console(Console):
    """A console whose width is unbounded when it writes to something other than a terminal (unless
    COLUMNS says otherwise): tables then take their natural width, and lines are not wrapped."""

    def _size(self) -> ConsoleDimensions:
        size = Console.size.fget(self)  # type: ignore[attr-defined]
        if self._width is None and not self.is_terminal:
            return ConsoleDimensions(UNBOUNDED_WIDTH, size.height)
        return size

    size = property(_size, Console.size.fset)  # type: ignore[assignment]


console = _Console()
err = Console(stderr=True, soft_wrap=True)  # one error, one line: never wrapped


def fail(message: str, code: int = 2) -> NoReturn:
    """One clear line on stderr and an exit code (2: bad input), never a traceback."""
    # Escaped: a message may hold brackets that are not markup (pip install 'tokenmill[bench]').
    err.print(f"[red]error:[/red] {escape(message)}", highlight=False)
    raise typer.Exit(code)


def need_extra(extra: str, command: str) -> None:
    """One line and exit 2 when `command` needs an extra that is not installed (tokenmill/extras.py).
    Called by each command before its work, not by a group's callback, which runs even for --help."""
    from tokenmill.extras import missing

    if (no_extra := missing(extra, command)) is not None:
        fail(str(no_extra))


def _amount(completed: float, total: float | None) -> str:
    """Work done: a count, a count of a total, or a percentage when the total is 1 (a fraction)."""
    if total is None:
        return f"{completed:.0f} completed"
    if total <= 1:
        return f"{100 * completed / total:.0f}%" if total else "0%"
    return f"{completed:.0f}/{total:.0f}"


class _Amount(ProgressColumn):
    def render(self, task: Task) -> Text:
        return Text(_amount(task.completed, task.total))


@dataclass
class _Step:
    description: str
    total: float | None
    start: float
    completed: float = 0.0
    last_line: float = 0.0
    finished: bool = False


class Steps:
    """Progress of long work, on stderr so that stdout keeps only the results: rich's bars on a
    terminal, plain lines elsewhere (a pipe, a log file, a parent process), where a live display would
    show nothing until the end. The tasks are steps done one after another: in plain lines a task's
    last line comes when it reaches its total, when the next one starts, or at the end; in between, a
    line at most every `every_s` seconds. The calls are rich.progress.Progress's."""

    def __init__(self, every_s: float = 10.0) -> None:
        self.every_s = every_s
        live = err.is_terminal and not err.is_dumb_terminal
        self._bars = (
            Progress(
                TextColumn("{task.description}"), BarColumn(), _Amount(), TimeElapsedColumn(), console=err
            )
            if live
            else None
        )
        self._steps: list[_Step] = []  # plain lines

    def __enter__(self) -> Steps:
        if self._bars is not None:
            self._bars.start()
        return self

    def __exit__(
        self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        if self._bars is not None:
            self._bars.stop()
        for step in self._steps:
            self._finish(step)

    def add_task(self, description: str, total: float | None = None) -> int:
        if self._bars is not None:
            return int(self._bars.add_task(description, total=total))
        for step in self._steps:
            self._finish(step)
        now = time.perf_counter()
        self._steps.append(_Step(description, total, now, last_line=now))
        _line(f"{description} ...")
        return len(self._steps) - 1

    def update(
        self,
        task: int,
        completed: float | None = None,
        total: float | None = None,
        description: str | None = None,
    ) -> None:
        if self._bars is not None:
            self._bars.update(TaskID(task), completed=completed, total=total, description=description)
            return
        step = self._steps[task]
        if description is not None:
            step.description = description
        if total is not None:
            step.total = total
        if completed is not None:
            step.completed = completed
        self._tick(step)

    def advance(self, task: int, amount: float = 1.0) -> None:
        if self._bars is not None:
            self._bars.advance(TaskID(task), amount)
            return
        step = self._steps[task]
        step.completed += amount
        self._tick(step)

    def _tick(self, step: _Step) -> None:
        if step.finished:
            return
        now = time.perf_counter()
        if step.total is not None and step.completed >= step.total:
            self._finish(step)
        elif now - step.last_line >= self.every_s:
            step.last_line = now
            _line(f"{step.description}: {_amount(step.completed, step.total)} ({now - step.start:.0f} s)")

    @staticmethod
    def _finish(step: _Step) -> None:
        if step.finished:
            return
        step.finished = True
        # a fraction's 100% says nothing: a count does (requests completed)
        done = (
            "" if step.total is not None and step.total <= 1 else f"{_amount(step.completed, step.total)}, "
        )
        _line(f"{step.description}: {done}done in {time.perf_counter() - step.start:.1f} s")


def _line(text: str) -> None:
    err.print(text, highlight=False, markup=False)
