"""``reach``: the command line. The user's commands are here; other distributions add
command groups through the ``reach.commands`` entry-point group (the server registers its
operator commands, ``reach migrate``, ``reach keys ...``, ``reach dev``, that way).

An entry point names ``register(subparsers)``: it adds its parsers, each with a ``handler``
default taking the parsed arguments and returning the exit status.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
from importlib.metadata import entry_points

from reach_client.cli import exits
from reach_client.cli.render import printable
from reach_client.config import ConfigurationError, NoAPIKeyError
from reach_client.errors import APIConnectionError, APIStatusError, ReachError

PLUGIN_GROUP = "reach.commands"
EPILOG = """configuration: --url, --api-key, --profile and --json go before the command or
after it (after it wins). The URL and key: --url/--api-key, else REACH_URL and REACH_API_KEY,
else the profile (--profile or REACH_PROFILE, default "default") of the file REACH_CONFIG
names, else of $XDG_CONFIG_HOME/reach/config.toml (~/.config/reach/config.toml when
XDG_CONFIG_HOME is unset). The URL defaults to http://localhost:8000.

exit status: 0 done or succeeded, 1 task failed, 2 usage, 3 task expired, 4 task cancelled,
5 --timeout ran out (the task goes on), 6 the API refused (its problem code is printed),
7 the API could not be reached, 130 interrupted, 141 stdout was closed (a reader such as
head stopped reading)."""


def parser() -> argparse.ArgumentParser:
    from reach_client.cli import resources, tasks
    from reach_client.cli.arguments import common

    root = argparse.ArgumentParser(
        prog="reach",
        description="Agent-Reach from the command line.",
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
        parents=[common(after_command=False)],
    )
    sub = root.add_subparsers(dest="command", required=True, metavar="COMMAND")
    shared = common()
    tasks.register(sub, shared)
    resources.register(sub, shared)
    for entry in entry_points(group=PLUGIN_GROUP):
        try:
            entry.load()(sub)
        except Exception as exc:  # a broken plugin must not take the user's commands down
            print(f"reach: the {entry.name!r} commands are unavailable: {exc}", file=sys.stderr)
    return root


def interrupted(args: argparse.Namespace, exc: KeyboardInterrupt) -> str:
    """What a Ctrl-C leaves behind, so the task can be found (``--json`` printed no id)."""
    submitted = getattr(args, "submitted", None)  # a task that has not ended
    if submitted is not None:
        task_id = printable(submitted)
        return f"interrupted: task {task_id} goes on (reach tasks watch {task_id})"
    key = getattr(exc, "idempotency_key", None)
    if getattr(args, "submits", False) and key is not None:
        # Sent, perhaps not taken: the same key reaches its task if it was, and makes one if not
        key = printable(key)
        return f"interrupted: to submit again, add --idempotency-key {key} (it may have a task)"
    return "interrupted"


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    try:
        return int(args.handler(args))
    except BrokenPipeError:
        # The reader of stdout went away (``| head -1``): stop quietly, as Unix tools do.
        # Whatever stdout still buffers goes nowhere, so the flush at exit raises nothing.
        with contextlib.suppress(OSError, ValueError):  # a stdout with no descriptor
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return exits.BROKEN_PIPE
    except KeyboardInterrupt as exc:
        print(interrupted(args, exc), file=sys.stderr)
        return exits.INTERRUPTED
    except NoAPIKeyError as exc:
        where = printable(exc.config_path)
        print(
            f"reach: no API key: give --api-key, set REACH_API_KEY, or add api_key to a "
            f"profile in {where}",
            file=sys.stderr,
        )
        return exits.USAGE
    except ConfigurationError as exc:
        print(f"reach: {printable(exc.detail)}", file=sys.stderr)
        return exits.USAGE
    except APIConnectionError as exc:
        print(f"reach: cannot reach the API: {printable(exc.detail)}", file=sys.stderr)
        if exc.idempotency_key is not None and exc.sent:
            # It may have made its task: the same key reaches it, and makes none twice
            key = printable(exc.idempotency_key)
            print(f"reach: to submit again, add --idempotency-key {key}", file=sys.stderr)
        return exits.UNREACHABLE
    except APIStatusError as exc:  # its problem is the server's text
        print(f"reach: {printable(exc)}", file=sys.stderr)
        for problem in exc.problem.get("errors") or []:
            print(f"  {printable(problem)}", file=sys.stderr)
        return exits.API_ERROR
    except ReachError as exc:
        print(f"reach: {printable(exc)}", file=sys.stderr)
        return exits.API_ERROR
