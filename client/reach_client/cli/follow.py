"""Following a task as it runs: a live progress bar on stderr, its outputs as they come, and
the finished task at the end. The events come from the task's stream, which resumes by
itself when the connection drops."""

from __future__ import annotations

import math
import signal
import time
from collections.abc import Iterator
from contextlib import contextmanager

from rich.progress import BarColumn, Progress, TaskProgressColumn, TextColumn, TimeElapsedColumn
from rich.text import Text

from reach_client.cli import render
from reach_client.client import Reach
from reach_client.models import Task


def progress_bar(*, as_json: bool) -> Progress:
    """The status and the message are the server's text: shown as ``printable`` text, never
    read as markup.

    While the bar is live, rich can send what is written to ``sys.stdout`` to its own console
    (stderr), folded to the terminal's width, so that lines show above the bar: only when
    stdout is a terminal as stderr is, and never JSON (``as_json``), which goes to stdout
    whole. JSON written to the terminal the bar is drawn on would be drawn over: no bar then."""
    one_screen = render.stdout().is_terminal and render.stderr().is_terminal
    return Progress(
        TextColumn("{task.fields[status]:<9}", markup=False),
        BarColumn(),
        TaskProgressColumn(),
        TimeElapsedColumn(),
        TextColumn("{task.description}", markup=False),
        console=render.stderr(),
        transient=False,
        redirect_stdout=one_screen and not as_json,
        disable=one_screen and as_json,
    )


class StillRunning(Exception):
    """The wait ran out before the task ended (``--timeout``); the task goes on."""


@contextmanager
def time_limit(seconds: float | None) -> Iterator[float]:
    """The monotonic deadline; ``StillRunning`` raised in this (the main) thread once it
    passes, even while it waits on the stream (SIGALRM, where the platform has it; elsewhere
    the caller checks the deadline between events)."""
    if seconds is None:
        yield float("inf")
        return
    deadline = time.monotonic() + seconds
    if not hasattr(signal, "setitimer"):
        yield deadline
        return

    def ran_out(signum: int, frame: object) -> None:
        raise StillRunning

    previous = signal.signal(signal.SIGALRM, ran_out)
    signal.setitimer(signal.ITIMER_REAL, max(seconds, 0.001))
    try:
        yield deadline
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


def follow(
    reach: Reach, task: Task, *, as_json: bool, events_as_json: bool, timeout: float | None = None
) -> Task:
    """Follow ``task`` to its end and return it finished; ``StillRunning`` after ``timeout``
    seconds.

    ``as_json`` leaves stdout to JSON: with ``events_as_json`` each event as one JSON line,
    else nothing here (the caller prints the finished task)."""
    out = render.stdout()
    finished = task
    with progress_bar(as_json=as_json) as bar, time_limit(timeout) as deadline:
        row = bar.add_task("", total=100, status=task.status)
        for event in reach.tasks.stream(task.task_id):
            if time.monotonic() > deadline:
                raise StillRunning
            if events_as_json:
                render.emit_json_line(event.raw)
            if event.type == "status" and isinstance(event.data, dict):
                bar.update(row, status=render.printable(event.data.get("status", "")))
                if "retry_in_s" in event.data:  # the attempt failed: the next starts afresh
                    bar.update(row, completed=0, description="")
            elif event.type == "progress" and isinstance(event.data, dict):
                percent = _percent(event.data.get("percent"))
                message = render.printable(event.data.get("message") or "")
                bar.update(row, completed=percent, description=message)
            elif event.type == "output" and not as_json:
                out.print(Text.assemble(("output", "cyan"), " ", render.json_text(event.data)))
            if event.final:
                finished = event.task or reach.tasks.get(task.task_id)
                done = 100 if finished.status == "succeeded" else None
                bar.update(row, status=render.printable(finished.status), completed=done)
    return finished


def _percent(value: object) -> float:
    """A progress event's percent within 0 to 100; 0 when it is no number (it is the
    server's, not to be trusted with a crash)."""
    try:
        percent = float(value) if isinstance(value, int | float | str) else 0.0
    except ValueError:
        return 0.0
    return min(max(percent, 0.0), 100.0) if math.isfinite(percent) else 0.0
