"""``reach submit`` and ``reach tasks list|get|cancel|watch``."""

from __future__ import annotations

import argparse
import itertools
from typing import Any

from reach_client.cli import exits, render
from reach_client.cli.arguments import (
    PAGE_MAX,
    count,
    identifier,
    json_object,
    open_client,
    seconds,
)
from reach_client.cli.follow import StillRunning, follow
from reach_client.models import FINAL, Task


def register(sub: Any, common: argparse.ArgumentParser) -> None:
    submit = sub.add_parser(
        "submit",
        parents=[common],
        help="submit a task",
        description="Submit a task; with --wait or --stream, follow it to its end and exit "
        "with its outcome (0 succeeded, 1 failed, 3 expired, 4 cancelled; 5 still running "
        "when --timeout ran out).",
    )
    submit.add_argument("capability")
    submit.add_argument(
        "--payload", type=json_object, default={}, help="JSON, @file or @- (stdin) [{}]"
    )
    how = submit.add_mutually_exclusive_group()
    how.add_argument("--wait", action="store_true", help="wait for the task, then print it")
    how.add_argument("--stream", action="store_true", help="print its events as they come")
    submit.add_argument("--timeout", type=seconds, help="with --wait or --stream: stop after S s")
    submit.add_argument("--idempotency-key")
    submit.add_argument("--deadline-ms", type=int)
    submit.add_argument("--session", dest="session_id")
    submit.add_argument("--priority", type=int)
    submit.add_argument("--max-attempts", type=int)
    submit.add_argument("--metadata", type=json_object)
    submit.add_argument("--target", help="an agent: AGENT@VERSION or AGENT@CHANNEL")
    submit.add_argument(
        "--queue-if-unavailable", action="store_true", help="wait in the queue when no agent"
    )
    submit.set_defaults(handler=run_submit, submits=True)

    tasks = sub.add_parser("tasks", help="list, read, cancel and watch tasks")
    verbs = tasks.add_subparsers(dest="verb", required=True, metavar="VERB")
    listing = verbs.add_parser("list", parents=[common], help="the tenant's tasks, newest first")
    listing.add_argument("--capability")
    listing.add_argument("--status", choices=sorted({"queued", "running", *FINAL}))
    listing.add_argument("--session", dest="session_id", help="only this session's tasks")
    listing.add_argument("--limit", type=count, default=20, help="how many to show [20]")
    listing.set_defaults(handler=run_list)
    for verb, handler, text in (
        ("get", run_get, "a task"),
        ("cancel", run_cancel, "cancel a queued or running task"),
        ("watch", run_watch, "follow a task: progress, outputs, outcome"),
    ):
        command = verbs.add_parser(verb, parents=[common], help=text)
        command.add_argument("task_id", type=identifier)
        command.set_defaults(handler=handler)
        if verb == "watch":
            command.add_argument("--timeout", type=seconds, help="stop watching after S s")


def show(args: argparse.Namespace, task: Task) -> None:
    if args.json:
        render.emit_json(task.raw)
    else:
        render.task_summary(render.stdout(), task)


def run_submit(args: argparse.Namespace) -> int:
    fields: dict[str, Any] = {
        "idempotency_key": args.idempotency_key,
        "deadline_ms": args.deadline_ms,
        "session_id": args.session_id,
        "priority": args.priority,
        "max_attempts": args.max_attempts,
        "metadata": args.metadata,
        "target": args.target,
        "queue_if_unavailable": True if args.queue_if_unavailable else None,
    }
    with open_client(args) as reach:
        task = reach.tasks.submit(args.capability, args.payload, **fields)
        args.submitted = task.task_id  # a Ctrl-C from here on names it
        if not (args.wait or args.stream):
            show(args, task)
            return exits.OK
        if not args.json:
            render.stderr().print(f"submitted task {render.printable(task.task_id)}")
        events_as_json = args.json and args.stream
        try:
            finished = follow(
                reach, task, as_json=args.json, events_as_json=events_as_json, timeout=args.timeout
            )
        except StillRunning:
            now = reach.tasks.get(task.task_id)
            return still_running(args, now, events_printed=events_as_json)
        args.submitted = None  # it has ended: nothing goes on
        return finish(args, finished, events_printed=events_as_json)


def still_running(args: argparse.Namespace, task: Task, *, events_printed: bool) -> int:
    """The task as it is when the wait ran out (unless its events were the output), and exit
    status 5: it goes on. One that ended before its final event came is finished."""
    if task.final:
        return finish(args, task, events_printed=events_printed)
    task_id, status = render.printable(task.task_id), render.printable(task.status)
    render.stderr().print(f"task {task_id} is still {status} after {args.timeout:g} s")
    if not events_printed:
        show(args, task)
    return exits.STILL_RUNNING


def finish(args: argparse.Namespace, task: Task, *, events_printed: bool) -> int:
    """The finished task printed (as JSON unless its events were), and its exit status."""
    if not args.json:
        render.task_summary(render.stdout(), task)
    elif not events_printed:
        render.emit_json(task.raw)
    return exits.for_status(task.status)


def run_watch(args: argparse.Namespace) -> int:
    with open_client(args) as reach:
        task = reach.tasks.get(args.task_id)
        try:
            finished = follow(
                reach, task, as_json=args.json, events_as_json=args.json, timeout=args.timeout
            )
        except StillRunning:
            now = reach.tasks.get(task.task_id)
            return still_running(args, now, events_printed=args.json)
        return finish(args, finished, events_printed=args.json)


def run_get(args: argparse.Namespace) -> int:
    with open_client(args) as reach:
        show(args, reach.tasks.get(args.task_id))
    return exits.OK


def run_cancel(args: argparse.Namespace) -> int:
    with open_client(args) as reach:
        show(args, reach.tasks.cancel(args.task_id))
    return exits.OK


def run_list(args: argparse.Namespace) -> int:
    with open_client(args) as reach:
        found = reach.tasks.list(
            capability=args.capability,
            status=args.status,
            session_id=args.session_id,
            limit=min(args.limit, PAGE_MAX),
        )
        tasks = list(itertools.islice(found, max(args.limit, 0)))
    if args.json:
        render.emit_json([t.raw for t in tasks])
        return exits.OK
    rows = [
        (
            t.task_id,
            t.capability,
            render.status(t.status),
            f"{t.progress.percent:.0f}%" if t.progress else None,
            render.when(t.created_at),
            t.error.code if t.error else None,
        )
        for t in tasks
    ]
    columns = ("task", "capability", "status", "progress", "created", "error")
    render.stdout().print(render.table(None, columns, rows))
    return exits.OK
