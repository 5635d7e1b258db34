"""The ``reach`` command's user side, run as installed (the console script, in a subprocess)
against the running stack; ``reach tasks watch`` in a pseudo-terminal, as a person sees it."""

from __future__ import annotations

import json
import os
import pty
import re
import subprocess
import sys
from pathlib import Path

import pytest
from reach_client import Reach

from tests.integration.stack import CeleryProcess, ServedApp
from tests.ptys import read_until_closed

REACH = str(Path(sys.executable).parent / "reach")
TEXT = "Queues decouple callers. Agents advertise cards. Leases expire. Streams resume."


@pytest.fixture
def env(api: ServedApp, tenant: tuple[str, str], worker: CeleryProcess) -> dict[str, str]:
    """The environment of a user of a fresh tenant: the URL and key, and no profile file."""
    base = {k: v for k, v in os.environ.items() if not k.startswith("REACH_")}
    return {
        **base,
        "REACH_URL": api.url,
        "REACH_API_KEY": tenant[1],
        "REACH_CONFIG": "/nonexistent/reach.toml",
    }


def reach(env: dict[str, str], *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [REACH, *args], env=env, capture_output=True, text=True, timeout=120, check=False
    )


def test_submit_wait_json_prints_only_the_succeeded_task(env: dict[str, str]) -> None:
    done = reach(env, "submit", "echo", "--payload", '{"a": 1}', "--wait", "--json")
    assert done.returncode == 0, done.stderr
    task = json.loads(done.stdout)  # stdout holds the JSON and nothing else
    assert (task["status"], task["result"], task["capability"]) == ("succeeded", {"a": 1}, "echo")


def test_exit_status_says_failed_and_expired(env: dict[str, str]) -> None:
    failed = reach(env, "submit", "echo", "--payload", '{"fail": "boom"}', "--wait", "--json")
    assert failed.returncode == 1, failed.stderr
    assert json.loads(failed.stdout)["error"]["code"] == "boom"
    expired = reach(env, "submit", "test.short-fuse", "--wait", "--json")
    assert expired.returncode == 3, expired.stderr
    assert json.loads(expired.stdout)["status"] == "expired"


def test_a_wait_that_runs_out_exits_5_and_the_task_goes_on(env: dict[str, str]) -> None:
    slow = '{"sleep_s": 30}'
    waited = reach(
        env, "submit", "test.sleepy", "--payload", slow, "--wait", "--timeout", "1", "--json"
    )
    assert waited.returncode == 5, waited.stderr
    assert "is still" in waited.stderr
    first = json.loads(waited.stdout)  # the task as it is when the wait ran out
    assert first["status"] in ("queued", "running")
    assert reach(env, "tasks", "cancel", first["task_id"]).returncode == 0
    streamed = reach(
        env, "submit", "test.sleepy", "--payload", slow, "--stream", "--json", "--timeout", "1"
    )
    assert streamed.returncode == 5, streamed.stderr
    events = [json.loads(line) for line in streamed.stdout.splitlines()]  # the events so far
    assert [(e["type"], e["data"]["status"]) for e in events] == [
        ("status", "queued"),
        ("status", "running"),
    ]
    task_id = streamed.stderr.split("task ", 1)[1].split()[0]
    watched = reach(env, "tasks", "watch", task_id, "--timeout", "1", "--json")
    assert watched.returncode == 5, watched.stderr
    assert reach(env, "tasks", "cancel", task_id).returncode == 0
    # A timeout the task beats changes nothing
    done = reach(env, "submit", "echo", "--payload", "{}", "--wait", "--timeout", "60", "--json")
    assert done.returncode == 0, done.stderr
    assert reach(env, "submit", "echo", "--wait", "--timeout", "0").returncode == 2


def test_an_agents_text_is_shown_as_text_never_as_markup_or_terminal_control(
    env: dict[str, str],
) -> None:
    hostile = (
        "\x1b[2J\x1b[H\x1b[32mtask succeeded\x1b[0m [link=https://evil.example/]docs[/link] "
        "[/x] \x9b31m"
    )
    shown = "[2J[H[32mtask succeeded[0m [link=https://evil.example/]docs[/link] [/x] 31m"
    payload = json.dumps({"fail": "boom", "message": hostile})
    waited = reach(env, "submit", "echo", "--payload", payload, "--wait")
    assert waited.returncode == 1 and "Traceback" not in waited.stderr, waited.stderr
    task_id = waited.stderr.split("task ", 1)[1].split()[0]
    got = reach(env, "tasks", "get", task_id)
    assert got.returncode == 0, got.stderr
    for printed in (waited.stdout, got.stdout):
        assert "\x1b" not in printed and "\x9b" not in printed
        assert f"error boom: {shown}" in printed, printed
    # --json keeps the text whole, C1 escaped: the same JSON, safe in a terminal
    echoed = {"note": "\x9b31m\x85 caf\u00e9"}
    done = reach(env, "submit", "echo", "--payload", json.dumps(echoed), "--wait", "--json")
    assert done.returncode == 0, done.stderr
    assert "\x9b" not in done.stdout and "\x85" not in done.stdout and "caf\u00e9" in done.stdout
    assert json.loads(done.stdout)["result"] == echoed


def test_submit_stream_json_prints_every_event_once_in_order(env: dict[str, str]) -> None:
    payload = json.dumps({"text": TEXT, "max_sentences": 2})
    streamed = reach(env, "submit", "text.summarize", "--payload", payload, "--stream", "--json")
    assert streamed.returncode == 0, streamed.stderr
    events = [json.loads(line) for line in streamed.stdout.splitlines()]
    assert [e["seq"] for e in events] == list(range(1, len(events) + 1))
    assert [e["type"] for e in events if e["type"] == "output"] == ["output", "output"]
    assert events[-1]["type"] == "succeeded"


def test_watch_draws_the_progress_bar_and_the_outputs_in_a_terminal(
    env: dict[str, str], api: ServedApp, tenant: tuple[str, str]
) -> None:
    with Reach(api.url, tenant[1]) as client:
        task = client.tasks.submit(
            "text.summarize", {"text": TEXT, "max_sentences": 3, "delay_s": 0.3}
        )
    screen = run_in_terminal([REACH, "tasks", "watch", task.task_id], env)
    assert "100%" in screen, screen
    assert "━" in screen, screen  # the bar itself
    assert "Queues decouple callers." in screen and '"index": 3' in screen, screen
    assert "succeeded" in screen, screen


def run_in_terminal(argv: list[str], env: dict[str, str]) -> str:
    """Run ``argv`` with a pseudo-terminal as its stdout and stderr; all it wrote."""
    controller, terminal = pty.openpty()
    process = subprocess.Popen(
        argv,
        env={**env, "TERM": "xterm-256color", "COLUMNS": "120", "LINES": "40"},
        stdin=subprocess.DEVNULL,
        stdout=terminal,
        stderr=terminal,
    )
    os.close(terminal)
    written = read_until_closed(controller)
    assert process.wait(timeout=60) == 0, written.decode(errors="replace")
    return re.sub(r"\x1b\[[0-9;?]*[A-Za-z]", "", written.decode(errors="replace"))


def test_lists_are_tables_and_json(env: dict[str, str]) -> None:
    submitted = json.loads(reach(env, "submit", "echo", "--json").stdout)
    listed = reach(env, "tasks", "list", "--json")
    assert [t["task_id"] for t in json.loads(listed.stdout)] == [submitted["task_id"]]
    table = reach(env, "tasks", "list")
    assert table.returncode == 0 and submitted["task_id"] in table.stdout
    agents = reach(env, "agents")
    assert agents.returncode == 0 and "echo" in agents.stdout
    capabilities = json.loads(reach(env, "capabilities", "--json").stdout)
    assert "echo" in {c["capability"] for c in capabilities}


def test_sessions_and_a_stale_revision_is_an_api_error(env: dict[str, str]) -> None:
    created = json.loads(reach(env, "sessions", "create", "--state", '{"n": 1}', "--json").stdout)
    sid = created["session_id"]
    updated = reach(env, "sessions", "update", sid, "--state", '{"n": 2}', "--revision", "1")
    assert updated.returncode == 0, updated.stderr
    stale = reach(env, "sessions", "update", sid, "--state", '{"n": 3}', "--revision", "1")
    assert stale.returncode == 6
    assert "revision_conflict" in stale.stderr and stale.stdout == ""
    revisions = json.loads(reach(env, "sessions", "revisions", sid, "--json").stdout)
    assert [r["revision"] for r in revisions] == [2, 1]


def test_sessions_list_and_the_tasks_of_one_session(env: dict[str, str]) -> None:
    first = json.loads(reach(env, "sessions", "create", "--json").stdout)["session_id"]
    second = json.loads(reach(env, "sessions", "create", "--json").stdout)["session_id"]
    listed = json.loads(reach(env, "sessions", "list", "--json").stdout)
    assert [s["session_id"] for s in listed] == [second, first]  # newest first
    table = reach(env, "sessions", "list")
    assert table.returncode == 0 and second in table.stdout
    submitted = reach(env, "submit", "echo", "--payload", '{"n": 1}', "--session", first, "--json")
    assert submitted.returncode == 0, submitted.stderr
    reach(env, "submit", "echo", "--payload", '{"n": 2}', "--json")  # in no session
    of_first = json.loads(reach(env, "tasks", "list", "--session", first, "--json").stdout)
    assert [t["task_id"] for t in of_first] == [json.loads(submitted.stdout)["task_id"]]
    assert json.loads(reach(env, "tasks", "list", "--session", second, "--json").stdout) == []


def test_webhooks_create_list_and_delete(env: dict[str, str]) -> None:
    created = reach(env, "webhooks", "create", "http://127.0.0.1:9/hook", "--json")
    hook = json.loads(created.stdout)
    assert hook["secret"].startswith("whsec_")
    listed = reach(env, "webhooks", "list", "--json")
    assert [h["webhook_id"] for h in json.loads(listed.stdout)] == [hook["webhook_id"]]
    assert reach(env, "webhooks", "delete", hook["webhook_id"]).returncode == 0
    gone = reach(env, "webhooks", "get", hook["webhook_id"])
    assert gone.returncode == 6 and "webhook_not_found" in gone.stderr


def test_without_a_key_it_is_a_usage_error_naming_the_commands_own_ways(
    env: dict[str, str],
) -> None:
    del env["REACH_API_KEY"]
    result = reach(env, "tasks", "list")
    assert result.returncode == 2 and "REACH_API_KEY" in result.stderr
    # the command's option, not the Python client's argument
    assert "--api-key" in result.stderr and "api_key=" not in result.stderr, result.stderr


@pytest.mark.parametrize("url", ["http://localhost:80a0", "localhost:8000"])
def test_a_url_that_names_no_http_host_is_a_usage_error(env: dict[str, str], url: str) -> None:
    # Given a typo in the API's URL (a port that is not a number, no scheme)
    env["REACH_URL"] = url
    # When a command runs
    result = reach(env, "tasks", "list")
    # Then it is told as a usage error (2), never a traceback (1 says a task failed) nor an
    # API out of reach (7)
    assert result.returncode == 2, result.stderr
    assert "Traceback" not in result.stderr and repr(url) in result.stderr, result.stderr


def test_the_url_and_key_work_before_the_command_and_the_ones_after_it_win(
    env: dict[str, str],
) -> None:
    # Given a user whose environment names neither the API nor a key
    url, key = env.pop("REACH_URL"), env.pop("REACH_API_KEY")
    submitted = json.loads(
        reach(env, "submit", "echo", "--url", url, "--api-key", key, "--json").stdout
    )
    # When they come before the command (and --json too), it lists the tenant's task
    before = reach(env, "--url", url, "--api-key", key, "--json", "tasks", "list")
    assert before.returncode == 0, before.stderr
    assert [t["task_id"] for t in json.loads(before.stdout)] == [submitted["task_id"]]
    # and given on both sides, the one after the command is used: a dead URL before it is
    # never asked, a dead one after it is
    nowhere = "http://127.0.0.1:9"
    after_wins = reach(env, "--url", nowhere, "--api-key", key, "tasks", "list", "--url", url)
    assert after_wins.returncode == 0, after_wins.stderr
    dead_after = reach(env, "--url", url, "--api-key", key, "tasks", "list", "--url", nowhere)
    assert dead_after.returncode == 7, dead_after.stderr


def test_a_closed_stdout_ends_it_quietly_with_141(env: dict[str, str]) -> None:
    # Given a stdout whose reader is gone (``reach ... | head -0``): a pipe, its read end shut
    read_end, write_end = os.pipe()
    os.close(read_end)
    try:
        # When it streams a task's events there as JSON lines
        streamed = subprocess.run(
            [REACH, "submit", "echo", "--payload", "{}", "--stream", "--json"],
            env=env,
            stdout=write_end,
            stderr=subprocess.PIPE,
            text=True,
            timeout=120,
            check=False,
        )
    finally:
        os.close(write_end)
    # Then it stops with 128 + SIGPIPE, as Unix tools do, and no traceback: not 1, which
    # says the task failed
    assert streamed.returncode == 141, streamed.stderr
    assert "Traceback" not in streamed.stderr and "BrokenPipe" not in streamed.stderr
