"""What every user command shares: where the API is (``--url``, ``--api-key``, ``--profile``,
else ``REACH_URL``, ``REACH_API_KEY``, ``REACH_PROFILE`` and the profile file), ``--json``,
and JSON arguments given inline, as ``@file`` or as ``@-`` (stdin)."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from reach_client.client import Reach

PAGE_MAX = 100  # a page the server serves whole (its list_page_max, by default)


def common(*, after_command: bool = True) -> argparse.ArgumentParser:
    """The options every user command takes, before the command (``reach --url X tasks
    list``, ``after_command=False``: the top level's) or after it. Given after the command,
    an option has no default: a subcommand's parser copies each of its attributes over the
    top level's, so a default there would undo ``--url`` given before the command."""
    unset = argparse.SUPPRESS if after_command else None
    shared = argparse.ArgumentParser(add_help=False)
    where = shared.add_argument_group("connection")
    where.add_argument(
        "--url",
        default=unset,
        help="the API's base URL [REACH_URL, else the profile, else http://localhost:8000]",
    )
    where.add_argument(
        "--api-key", default=unset, help="the API key [REACH_API_KEY, else the profile]"
    )
    where.add_argument(
        "--profile",
        default=unset,
        help="a profile of the config file (see reach --help) [REACH_PROFILE]",
    )
    shared.add_argument(
        "--json",
        action="store_true",
        default=unset if after_command else False,
        help="print JSON only on stdout (for scripts)",
    )
    return shared


def open_client(args: argparse.Namespace) -> Reach:
    return Reach(args.url, args.api_key, profile=args.profile)


def json_argument(text: str) -> Any:
    """``argparse`` type: JSON, ``@path`` to read it from a file, ``@-`` from stdin."""
    try:
        if text == "@-":
            text = sys.stdin.read()
        elif text.startswith("@"):
            text = Path(text[1:]).read_text(encoding="utf-8")
        return json.loads(text)
    except (OSError, ValueError) as exc:
        raise argparse.ArgumentTypeError(f"not JSON: {exc}") from exc


def json_object(text: str) -> dict[str, Any]:
    value = json_argument(text)
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError("must be a JSON object")
    return value


def comma_list(text: str) -> list[str]:
    return [part.strip() for part in text.split(",") if part.strip()]


def count(text: str) -> int:
    """A whole number above 0 (``--limit``): -5 showed an empty table and exited 0."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a whole number: {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"at least 1: {text!r}")
    return value


def identifier(text: str) -> str:
    """An id (a task's, a session's): not empty. ``tasks get ''`` asked for ``/tasks/``,
    which redirects to the list, and was told to fix its URL."""
    if not text.strip():
        raise argparse.ArgumentTypeError("an id is not empty")
    return text


def seconds(text: str) -> float:
    """A positive number of seconds (``--timeout``)."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number of seconds: {text!r}") from None
    if not value > 0 or value == float("inf"):
        raise argparse.ArgumentTypeError(f"a number of seconds above 0: {text!r}")
    return value
