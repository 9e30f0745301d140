"""Progress for people watching: synthesis phases and benchmark loops as a rich progress bar
when run interactively (a terminal or a notebook); silent in CI, with `verbose=False`, or
when output goes to a file. Code reports with `phase(name)` and needs no reporter passed."""
from __future__ import annotations

import contextlib
import contextvars
import os
import sys

#: what `hs.parallelize(...).plan` goes through, in order (the bar's steps)
PHASES = ("trace", "lift", "structure", "baselines", "starts", "local search", "CP-SAT",
          "share grid")

_reporter: contextvars.ContextVar = contextvars.ContextVar("hapsynth_progress", default=None)


def interactive() -> bool:
    """A person is likely watching: a notebook kernel or a terminal, and not CI."""
    if os.environ.get("CI", "").lower() not in ("", "0", "false"):
        return False
    return "ipykernel" in sys.modules or sys.stderr.isatty()


def _progress(transient: bool):
    from rich.console import Console
    from rich.progress import (BarColumn, Progress, SpinnerColumn, TextColumn, TimeElapsedColumn,
                               TimeRemainingColumn)

    # refreshed only when it advances, from the caller's thread: in a notebook a refresh
    # thread would race the cell's prints into the bar's output widget
    return Progress(SpinnerColumn(), TextColumn("[bold]hapsynth[/] {task.description}"),
                    BarColumn(), TextColumn("{task.completed}/{task.total}"), TimeElapsedColumn(),
                    TimeRemainingColumn(), console=Console(stderr=True), transient=transient,
                    redirect_stdout=False, redirect_stderr=False, auto_refresh=False)


@contextlib.contextmanager
def reporting(verbose: bool | None = None, phases=PHASES):
    """Within this block, `phase()` calls advance a bar over `phases` (shown only if
    `verbose`, or, when None, if `interactive()`). Nested blocks report to the outer bar."""
    if _reporter.get() is not None or not (interactive() if verbose is None else verbose):
        yield
        return
    with _progress(transient=True) as bar:
        task = bar.add_task(phases[0], total=len(phases))

        def report(name: str) -> None:
            done = phases.index(name) if name in phases else None
            bar.update(task, description=name, refresh=True,
                       **({} if done is None else {"completed": done}))

        token = _reporter.set(report)
        try:
            yield
        finally:
            bar.update(task, completed=len(phases), description="done", refresh=True)
            _reporter.reset(token)


def phase(name: str) -> None:
    """Report that work named `name` starts (no-op when nobody watches)."""
    report = _reporter.get()
    if report is not None:
        report(name)


def track(items, description: str, total: int | None = None, verbose: bool | None = None):
    """`items`, with a bar and the estimated time left while a person watches (benchmarks)."""
    items = list(items) if total is None and not hasattr(items, "__len__") else items
    if not (interactive() if verbose is None else verbose):
        yield from items
        return
    with _progress(transient=False) as bar:
        task = bar.add_task(description, total=len(items) if total is None else total)
        bar.refresh()
        for item in items:
            yield item
            bar.advance(task)
            bar.refresh()
