"""Where ``reach`` writes while it follows a task. With ``--json`` its events go to stdout,
one whole line each, even while the progress bar is live on a terminal's stderr (rich would
take what goes to ``sys.stdout`` to that terminal, folded to its width). After a failed
attempt the bar starts the next one afresh. ``reach`` runs against a loopback server
(``client_loopback``): as installed, with a pseudo-terminal for its stderr, or in-process."""

from __future__ import annotations

import json
import os
import pty
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from reach_client.cli import main

from tests.integration.receiver import Reply
from tests.ptys import read_until_closed
from tests.unit.client_loopback import TASK, DyingAPI, Loopback, events_reply, task_reply

# Lines far wider than the terminal below (40 columns)
WIDE = "an output far wider than the terminal it is shown on, " * 3
EVENTS = [
    {"seq": 1, "type": "status", "data": {"status": "running"}},
    {"seq": 2, "type": "progress", "data": {"percent": 50, "message": "half way"}},
    {"seq": 3, "type": "output", "data": {"text": WIDE}},
    {"seq": 4, "type": "succeeded", "data": {**TASK, "status": "succeeded"}},
]


def run_with_terminal_stderr(argv: list[str], url: str, stdout: Path) -> tuple[int, str]:
    """``reach argv`` with a pseudo-terminal as stderr and ``stdout`` a file: its exit
    status and all it wrote to the terminal."""
    controller, terminal = pty.openpty()
    env = {k: v for k, v in os.environ.items() if not k.startswith("REACH_")}
    env.update(
        REACH_URL=url,
        REACH_API_KEY="rk_test",
        REACH_CONFIG="/nonexistent/reach.toml",
        TERM="xterm-256color",
        COLUMNS="40",
        LINES="20",
    )
    with stdout.open("wb") as out:
        process = subprocess.Popen(
            [sys.executable, "-m", "reach_client.cli", *argv],
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=out,
            stderr=terminal,
        )
    os.close(terminal)
    written = read_until_closed(controller)
    return process.wait(timeout=60), written.decode(errors="replace")


@pytest.mark.parametrize(
    ("argv", "first"),
    [
        (["submit", "echo", "--stream", "--json"], task_reply("queued", 202)),
        (["tasks", "watch", "t1", "--json"], task_reply("running")),
    ],
    ids=["submit --stream", "tasks watch"],
)
def test_json_events_go_to_stdout_whole_while_stderr_is_a_terminal(
    argv: list[str], first: Reply, tmp_path: Path
) -> None:
    replies = [first, events_reply(*EVENTS)]
    with Loopback(lambda n: replies[n - 1]) as api:
        status, screen = run_with_terminal_stderr(argv, api.base_url, tmp_path / "out")

    assert status == 0, screen
    lines = (tmp_path / "out").read_text().splitlines()
    assert [json.loads(line) for line in lines] == EVENTS  # one whole line each, in order
    assert "far wider" not in screen  # none of it went to the terminal


def run_reach(replies: list[Reply], *argv: str, monkeypatch: pytest.MonkeyPatch) -> int:
    monkeypatch.setenv("REACH_CONFIG", "/nonexistent/reach.toml")
    monkeypatch.delenv("REACH_PROFILE", raising=False)
    monkeypatch.setenv("COLUMNS", "200")
    with Loopback(lambda n: replies[n - 1]) as api:
        return main([*argv, "--url", api.base_url, "--api-key", "rk_test"])


def test_a_retry_starts_the_progress_bar_afresh(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    # Given an attempt that got half way, failed, and is to run again; the next one fails
    # before any progress
    failed: dict[str, Any] = {**TASK, "status": "failed", "error": {"code": "boom"}}
    events = events_reply(
        {"seq": 1, "type": "status", "data": {"status": "running"}},
        {"seq": 2, "type": "progress", "data": {"percent": 60, "message": "page 3 of 5"}},
        {"seq": 3, "type": "status", "data": {"status": "queued", "retry_in_s": 2}},
        {"seq": 4, "type": "status", "data": {"status": "running"}},
        {"seq": 5, "type": "failed", "data": failed},
    )
    status = run_reach(
        [task_reply("running"), events], "tasks", "watch", "t1", monkeypatch=monkeypatch
    )
    bar = capsys.readouterr().err
    assert status == 1
    # I expect the bar to show the last attempt, not the first one's percent and message
    assert "failed" in bar and "0%" in bar, bar
    assert "60%" not in bar and "page 3 of 5" not in bar, bar


@pytest.mark.parametrize("as_json", [False, True], ids=["table", "--json"])
def test_a_task_that_ended_before_its_final_event_came_is_finished_not_still_running(
    as_json: bool, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    # Given a running task whose event stream brings nothing before the wait runs out (a
    # slow proxy), and which has failed by the time the task is read again
    monkeypatch.setenv("REACH_CONFIG", "/nonexistent/reach.toml")
    monkeypatch.delenv("REACH_PROFILE", raising=False)
    failed = task_reply("failed", error={"code": "boom", "message": "it broke"})

    def script(n: int) -> Reply:
        return {1: task_reply("running"), 3: failed}.get(n) or api.hold()

    with Loopback(script) as api:
        # When the watch runs out
        argv = ["tasks", "watch", "t1", "--timeout", "1", "--url", api.base_url, "--api-key", "k"]
        status = main(argv + (["--json"] if as_json else []))
    out, err = capsys.readouterr()
    # Then it exits with the task's own status (1: failed), never 5 (still running)
    assert status == 1, (status, err)
    assert "still" not in err, err
    if not as_json:  # and shows the task, as a watch that saw it end does
        assert "failed" in out and "boom" in out, out


def test_a_submit_that_got_no_answer_says_how_to_submit_it_again(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    # Given an API that takes the submit and dies before it answers (the task may be made)
    monkeypatch.setenv("REACH_CONFIG", "/nonexistent/reach.toml")
    monkeypatch.delenv("REACH_PROFILE", raising=False)
    with DyingAPI() as api:
        # When reach submits (its retries refused)
        status = main(["submit", "echo", "--url", api.base_url, "--api-key", "rk_test"])
    # Then it exits 7 (out of reach), naming the key the submit was sent with
    key = api.header("idempotency-key")
    assert status == 7
    assert f"to submit again, add --idempotency-key {key}\n" in capsys.readouterr().err


def test_a_submit_that_never_went_out_names_no_key(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    # Given no API at all: the connection is refused, nothing can have been made
    monkeypatch.setenv("REACH_CONFIG", "/nonexistent/reach.toml")
    monkeypatch.delenv("REACH_PROFILE", raising=False)
    status = main(["submit", "echo", "--url", "http://127.0.0.1:9", "--api-key", "rk_test"])
    assert status == 7
    assert "--idempotency-key" not in capsys.readouterr().err


def test_a_submit_interrupted_while_it_follows_names_its_task(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """With ``--json`` nothing had named the task: it went on with nothing to find it by."""
    from reach_client.cli import tasks

    def interrupted(*args: Any, **kwargs: Any) -> None:
        raise KeyboardInterrupt  # Ctrl-C while the task is followed

    monkeypatch.setenv("REACH_CONFIG", "/nonexistent/reach.toml")
    monkeypatch.delenv("REACH_PROFILE", raising=False)
    monkeypatch.setattr(tasks, "follow", interrupted)
    with Loopback(lambda n: task_reply("queued", 202)) as api:
        argv = ["submit", "echo", "--json", "--wait", "--url", api.base_url, "--api-key", "k"]
        status = main(argv)
    task_id = TASK["task_id"]
    assert status == 130
    assert capsys.readouterr().err == (
        f"interrupted: task {task_id} goes on (reach tasks watch {task_id})\n"
    )
