"""How ``reach`` shows things: JSON on stdout for scripts (``--json``), tables and short
summaries for people. Progress and errors go to stderr, so stdout holds only the answer."""

from __future__ import annotations

import json
import sys
from collections.abc import Iterable, Sequence
from datetime import datetime
from typing import Any

from rich.console import Console
from rich.table import Table

from reach_client.models import Task

STATUS_STYLE = {
    "queued": "yellow",
    "running": "blue",
    "succeeded": "green",
    "failed": "red",
    "expired": "magenta",
    "cancelled": "dim",
}


def stdout() -> Console:
    # No file given: rich writes to whatever sys.stdout is at the time (a live view
    # redirects it so that lines appear above the bar).
    return Console(highlight=False, soft_wrap=True)


def stderr() -> Console:
    return Console(stderr=True, highlight=False)


def emit_json(document: Any) -> None:
    sys.stdout.write(json.dumps(document, indent=2, ensure_ascii=False) + "\n")
    sys.stdout.flush()


def emit_json_line(document: Any) -> None:
    sys.stdout.write(json.dumps(document, ensure_ascii=False, separators=(",", ":")) + "\n")
    sys.stdout.flush()


def when(value: datetime | None) -> str:
    return value.astimezone().strftime("%Y-%m-%d %H:%M:%S") if value else "-"


def status(value: str) -> str:
    return f"[{STATUS_STYLE.get(value, 'white')}]{value}[/]"


def table(title: str | None, columns: Sequence[str], rows: Iterable[Sequence[Any]]) -> Table:
    shown = Table(title=title, title_justify="left", header_style="bold")
    for index, column in enumerate(columns):
        # The first column is the id people copy: never folded.
        shown.add_column(column, overflow="fold", no_wrap=index == 0)
    for row in rows:
        shown.add_row(*("-" if cell is None else str(cell) for cell in row))
    return shown


def task_summary(console: Console, task: Task) -> None:
    """A task for people: what it is, where it stands, and its result or error."""
    took = ""
    if task.started_at and task.finished_at:
        took = f" in {(task.finished_at - task.started_at).total_seconds():.2f} s"
    console.print(f"task {task.task_id} ({task.capability}): {status(task.status)}{took}")
    if task.progress and not task.final:
        message = f" {task.progress.message}" if task.progress.message else ""
        console.print(f"  progress {task.progress.percent:.0f}%{message}")
    if task.error:
        console.print(f"  [red]error {task.error.code}[/]: {task.error.message}")
    if task.result is not None:
        console.print_json(json.dumps(task.result, ensure_ascii=False))
