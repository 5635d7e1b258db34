"""Following a task as it runs: a live progress bar on stderr, its outputs as they come, and
the finished task at the end. The events come from the task's stream, which resumes by
itself when the connection drops."""

from __future__ import annotations

import json
from typing import Any

from rich.progress import BarColumn, Progress, TaskProgressColumn, TextColumn, TimeElapsedColumn

from reach_client.cli import render
from reach_client.client import Reach
from reach_client.models import Event, Task


def progress_bar() -> Progress:
    return Progress(
        TextColumn("{task.fields[status]:<9}"),
        BarColumn(),
        TaskProgressColumn(),
        TimeElapsedColumn(),
        TextColumn("{task.description}"),
        console=render.stderr(),
        transient=False,
    )


def describe(event: Event) -> str:
    data: Any = event.data
    if event.type == "output":
        return json.dumps(data, ensure_ascii=False)
    return json.dumps(data, ensure_ascii=False) if data is not None else ""


def follow(reach: Reach, task: Task, *, as_json: bool, events_as_json: bool) -> Task:
    """Follow ``task`` to its end and return it finished.

    ``as_json`` leaves stdout to JSON: with ``events_as_json`` each event as one JSON line,
    else nothing here (the caller prints the finished task)."""
    out = render.stdout()
    finished = task
    with progress_bar() as bar:
        row = bar.add_task("", total=100, status=task.status)
        for event in reach.tasks.stream(task.task_id):
            if events_as_json:
                render.emit_json_line(event.raw)
            if event.type == "status" and isinstance(event.data, dict):
                bar.update(row, status=str(event.data.get("status", "")))
            elif event.type == "progress" and isinstance(event.data, dict):
                percent = float(event.data.get("percent") or 0)
                bar.update(row, completed=percent, description=event.data.get("message") or "")
            elif event.type == "output" and not as_json:
                out.print(f"[cyan]output[/] {describe(event)}")
            if event.final:
                finished = event.task or reach.tasks.get(task.task_id)
                done = 100 if finished.status == "succeeded" else None
                bar.update(row, status=finished.status, completed=done)
    return finished
