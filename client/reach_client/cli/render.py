"""How ``reach`` shows things: JSON on stdout for scripts (``--json``), tables and short
summaries for people. Progress and errors go to stderr, so stdout holds only the answer.

What the server sends is an agent's or a tenant's text (an error message, a progress
message, a webhook's description): it is shown as text, never read as Rich markup (the
consoles read none: styles come as ``Text``) nor passed to the terminal as a control
sequence (every such string goes through ``printable``, JSON through ``json_text``)."""

from __future__ import annotations

import json
import re
import sys
from collections.abc import Iterable, Sequence
from datetime import datetime
from typing import Any

from rich.console import Console
from rich.highlighter import JSONHighlighter
from rich.table import Table
from rich.text import Text

from reach_client.models import Task

# C0 but tab and newline, DEL, C1, and lone surrogates (which no encoder can write).
NOT_PRINTABLE = re.compile(r"[\x00-\x08\x0b-\x1f\x7f-\x9f\ud800-\udfff]")
# What json.dumps(ensure_ascii=False) leaves as it is of those: it escapes C0 itself.
NOT_PRINTABLE_IN_JSON = re.compile(r"[\x7f-\x9f\ud800-\udfff]")

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
    return Console(highlight=False, soft_wrap=True, markup=False, emoji=False)


def stderr() -> Console:
    return Console(stderr=True, highlight=False, markup=False, emoji=False)


def printable(value: object, *, multiline: bool = False) -> str:
    """``value`` as text a terminal only displays: control characters and lone surrogates
    dropped, a newline turned to a space unless ``multiline``."""
    text = NOT_PRINTABLE.sub("", str(value))
    return text if multiline else text.replace("\n", " ")


def json_text(document: Any, **options: Any) -> str:
    """``document`` as JSON with its text readable (not ASCII-escaped) but every character a
    terminal could act on escaped: the same JSON, safe to print."""
    text = json.dumps(document, ensure_ascii=False, **options)
    return NOT_PRINTABLE_IN_JSON.sub(lambda found: f"\\u{ord(found[0]):04x}", text)


def emit_json(document: Any) -> None:
    sys.stdout.write(json_text(document, indent=2) + "\n")
    sys.stdout.flush()


def emit_json_line(document: Any) -> None:
    sys.stdout.write(json_text(document, separators=(",", ":")) + "\n")
    sys.stdout.flush()


def print_json(console: Console, document: Any) -> None:
    """``document`` indented and coloured, for people."""
    console.print(JSONHighlighter()(json_text(document, indent=2)), soft_wrap=True)


def when(value: datetime | None) -> str:
    return value.astimezone().strftime("%Y-%m-%d %H:%M:%S") if value else "-"


def status(value: str) -> Text:
    return Text(printable(value), style=STATUS_STYLE.get(value, "white"))


def table(title: str | None, columns: Sequence[str], rows: Iterable[Sequence[Any]]) -> Table:
    """Rows of cells: a ``Text`` as it is styled, None as "-", anything else as
    ``printable`` text."""
    shown = Table(title=title, title_justify="left", header_style="bold")
    for index, column in enumerate(columns):
        # The first column is the id people copy: never folded.
        shown.add_column(column, overflow="fold", no_wrap=index == 0)
    for row in rows:
        shown.add_row(*map(_cell, row))
    return shown


def _cell(value: object) -> Text:
    if isinstance(value, Text):
        return value
    return Text("-" if value is None else printable(value))


def task_summary(console: Console, task: Task) -> None:
    """A task for people: what it is, where it stands, and its result or error."""
    took = ""
    if task.started_at and task.finished_at:
        took = f" in {(task.finished_at - task.started_at).total_seconds():.2f} s"
    what = f"task {printable(task.task_id)} ({printable(task.capability)}): "
    console.print(Text.assemble(what, status(task.status), took))
    if task.progress and not task.final:
        message = f" {printable(task.progress.message)}" if task.progress.message else ""
        console.print(f"  progress {task.progress.percent:.0f}%{message}")
    if task.error:
        code, message = printable(task.error.code), printable(task.error.message, multiline=True)
        console.print(Text.assemble("  ", (f"error {code}", "red"), f": {message}"))
    if task.result is not None:
        print_json(console, task.result)
