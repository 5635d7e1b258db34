"""Where ``reach`` takes its connection options: before the command or after it, the one
after winning; a command given neither leaves them unset (the environment decides)."""

from __future__ import annotations

from typing import Any

import pytest
from reach_client.cli import parser


@pytest.mark.parametrize(
    "argv",
    [
        ["--url", "http://a:1", "--api-key", "k", "--profile", "p", "--json", "tasks", "list"],
        ["tasks", "list", "--url", "http://a:1", "--api-key", "k", "--profile", "p", "--json"],
        ["--url", "http://a:1", "--profile", "p", "submit", "echo", "--api-key", "k", "--json"],
        [
            "--api-key",
            "k",
            "--json",
            "sessions",
            "get",
            "S",
            "--url",
            "http://a:1",
            "--profile",
            "p",
        ],
    ],
)
def test_connection_options_are_taken_before_or_after_the_command(argv: list[str]) -> None:
    args = parser().parse_args(argv)
    assert (args.url, args.api_key, args.profile, args.json) == ("http://a:1", "k", "p", True)


def test_the_option_after_the_command_wins() -> None:
    argv = [
        "--url",
        "http://before:1",
        "--api-key",
        "before",
        "tasks",
        "list",
        "--url",
        "http://after:1",
    ]
    args = parser().parse_args(argv)
    assert (args.url, args.api_key) == ("http://after:1", "before")


def test_a_command_given_no_connection_option_leaves_them_unset() -> None:
    args = parser().parse_args(["webhooks", "list"])
    assert (args.url, args.api_key, args.profile, args.json) == (None, None, None, False)


def test_reach_api_serves_loopback_port_8000_in_one_process_unless_told() -> None:
    args = parser().parse_args(["api"])
    assert (args.host, args.port, args.workers) == ("127.0.0.1", 8000, 1)
    args = parser().parse_args(["api", "--host", "0.0.0.0", "--port", "9000", "--workers", "4"])
    assert (args.host, args.port, args.workers) == ("0.0.0.0", 9000, 4)


@pytest.mark.parametrize("workers", ["0", "-2", "two"])
def test_reach_api_refuses_fewer_than_one_process(
    workers: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exited:
        parser().parse_args(["api", "--workers", workers])
    assert exited.value.code == 2
    assert "--workers" in capsys.readouterr().err


@pytest.mark.parametrize(
    "argv",
    [
        ["tasks", "get", ""],
        ["tasks", "watch", " "],
        ["sessions", "get", ""],
        ["sessions", "delete", ""],
        ["webhooks", "delete", ""],
        ["tasks", "list", "--limit", "-5"],
        ["tasks", "list", "--limit", "0"],
        ["sessions", "list", "--limit", "x"],
    ],
)
def test_an_empty_id_or_a_count_below_one_is_a_usage_error(
    argv: list[str], capsys: pytest.CaptureFixture[str]
) -> None:
    """``tasks get ''`` asked for ``/tasks/`` and was told to fix its URL (exit 6);
    ``--limit -5`` showed an empty table and exited 0."""
    with pytest.raises(SystemExit) as exited:
        parser().parse_args(argv)
    assert exited.value.code == 2
    assert "Traceback" not in capsys.readouterr().err


def test_an_interrupted_command_names_the_task_it_submitted_or_the_key_it_sent(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    from reach_client import cli

    def interrupted(args: object) -> int:
        raise KeyboardInterrupt

    def interrupted_while_sent(args: object) -> int:
        stopped = KeyboardInterrupt()
        stopped.idempotency_key = "k-1"  # type: ignore[attr-defined]  # as ``keyed`` sets it
        raise stopped

    def interrupted_once_submitted(args: Any) -> int:
        args.submitted = "t-1"
        raise KeyboardInterrupt

    for argv, handler, said in (
        (["submit", "echo"], interrupted, "interrupted"),
        (
            ["submit", "echo"],
            interrupted_while_sent,
            "interrupted: to submit again, add --idempotency-key k-1 (it may have a task)",
        ),
        (
            ["submit", "echo", "--json", "--wait"],
            interrupted_once_submitted,
            "interrupted: task t-1 goes on (reach tasks watch t-1)",
        ),
        (["tasks", "list"], interrupted_while_sent, "interrupted"),
    ):
        args = parser().parse_args(argv)
        args.handler = handler
        monkeypatch.setattr(cli, "parser", lambda args=args: _Given(args))
        assert cli.main(argv) == 130
        assert capsys.readouterr().err.strip() == said


class _Given:
    """A parser that answers ``args`` whatever it is given."""

    def __init__(self, args: object) -> None:
        self.args = args

    def parse_args(self, argv: object) -> object:
        return self.args
