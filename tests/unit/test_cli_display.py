"""What the server sends reaches the terminal as text: never as a control sequence, never as
Rich markup. ``reach`` runs in-process against a loopback server that answers as a hostile
agent's task would read (``tests.integration.receiver``: no database behind it)."""

from __future__ import annotations

import json
from typing import Any

import pytest
from reach_client.cli import main, render

from tests.integration.receiver import Receiver, Reply

# An agent's text as the server stores it: clear the screen and claim success, a hyperlink
# in markup, a stray closing tag (rich's MarkupError), and an 8-bit CSI (C1).
HOSTILE = (
    "\x1b[2J\x1b[H\x1b[32mtask succeeded\x1b[0m [link=https://evil.example/]docs[/link] "
    "[/x] \x9b31m\x07"
)
# HOSTILE as shown: its control characters gone, its markup as it was written.
SHOWN = "[2J[H[32mtask succeeded[0m [link=https://evil.example/]docs[/link] [/x] 31m"
TASK = {"task_id": "t1", "capability": "echo", "status": "failed", "trace_id": "tr"}
FAILED = {**TASK, "error": {"code": "boom[/x]", "message": HOSTILE}}


def json_reply(document: Any) -> Reply:
    return Reply(200, {"Content-Type": "application/json"}, json.dumps(document).encode())


def sse_reply(*events: dict[str, Any]) -> Reply:
    frames = "".join(f"id: {e['seq']}\ndata: {json.dumps(e)}\n\n" for e in events)
    return Reply(200, {"Content-Type": "text/event-stream"}, frames.encode())


def run_reach(replies: list[Reply], *argv: str, monkeypatch: pytest.MonkeyPatch) -> int:
    """``reach argv`` against a server that gives ``replies`` in turn; its exit status."""
    monkeypatch.setenv("REACH_CONFIG", "/nonexistent/reach.toml")
    monkeypatch.delenv("REACH_PROFILE", raising=False)
    monkeypatch.setenv("COLUMNS", "400")  # a line is never folded: each text shows whole
    with Receiver(lambda n: replies[n - 1]) as server:
        url = f"http://127.0.0.1:{server.port}"
        return main([*argv, "--url", url, "--api-key", "rk_test"])


def assert_literal(written: str) -> None:
    assert "\x1b" not in written and "\x9b" not in written and "\x07" not in written
    assert SHOWN in written, written


def test_printable_drops_control_characters_but_tabs_and_asked_for_newlines() -> None:
    assert render.printable("a\x00b\x1b[2Jc\x7fd\x85e\x9bf\rg") == "ab[2Jcdefg"
    assert render.printable("one\ttwo\nthree") == "one\ttwo three"
    assert render.printable("one\ntwo", multiline=True) == "one\ntwo"
    assert render.printable("caf\u00e9 \ud800") == "caf\u00e9 "  # a lone surrogate cannot print


def test_json_text_escapes_c1_and_stays_the_same_json() -> None:
    document = {"k\x9b": ["\x1b[2J", "\x85caf\u00e9\x7f", "\ud800"]}
    written = render.json_text(document)
    assert not any(0x7F <= ord(c) <= 0x9F or 0xD800 <= ord(c) <= 0xDFFF for c in written)
    assert "\x1b" not in written and "caf\u00e9" in written  # printable text stays readable
    assert json.loads(written) == document


def test_a_table_cell_of_none_is_a_dash(capsys: pytest.CaptureFixture[str]) -> None:
    render.stdout().print(render.table(None, ("a", "b"), [(None, render.status("failed"))]))
    assert "│ - │ failed │" in capsys.readouterr().out


def test_get_shows_the_agents_error_as_text(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    hostile_capability = {**FAILED, "capability": "echo[/x]\x1b]8;;https://evil.example/\x07"}
    status = run_reach(
        [json_reply(hostile_capability)], "tasks", "get", "t1", monkeypatch=monkeypatch
    )
    out = capsys.readouterr().out
    assert status == 0
    assert_literal(out)
    assert "echo[/x]]8;;https://evil.example/" in out and "boom[/x]" in out


def test_watch_shows_progress_and_outputs_as_text(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    running = {**TASK, "status": "running"}
    done = {**TASK, "status": "succeeded", "result": {"text": HOSTILE}}
    events = sse_reply(
        # percents no agent of ours sends, which must not stop the watch either
        {"seq": 1, "type": "progress", "data": {"percent": "lots", "message": "a"}},
        {"seq": 2, "type": "progress", "data": {"percent": {"x": 1}, "message": "b"}},
        {"seq": 3, "type": "progress", "data": {"percent": "nan", "message": "c"}},
        {"seq": 4, "type": "progress", "data": {"percent": 50, "message": HOSTILE}},
        {"seq": 5, "type": "output", "data": {"text": HOSTILE}},
        {"seq": 6, "type": "status", "data": {"status": "[/x]\x1b[31m"}},
        {"seq": 7, "type": "succeeded", "data": done},
    )
    status = run_reach(
        [json_reply(running), events], "tasks", "watch", "t1", monkeypatch=monkeypatch
    )
    written = capsys.readouterr()
    assert status == 0
    assert_literal(written.err)  # the progress bar's line
    for shown in (written.out, written.err):
        assert "\x1b" not in shown and "\x9b" not in shown
    assert "[link=https://evil.example/]docs[/link] [/x]" in written.out  # the output, as JSON
    assert "\\u001b[2J" in written.out and "\\u009b31m" in written.out


def test_tables_show_every_cell_as_text(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    page = {"tasks": [{**FAILED, "capability": HOSTILE, "status": HOSTILE}], "next_cursor": None}
    hook = {
        "webhook_id": "wh1",
        "url": "http://example.com/[/x]",
        "events": ["task.failed"],
        "status": HOSTILE,
        "description": HOSTILE,
    }
    delivery = {
        "delivery_id": "d1",
        "task_id": "t1",
        "event_type": "task.failed",
        "url": "http://example.com/",
        "status": "failed",
        "last_error": HOSTILE,
    }
    for replies, argv in (
        ([json_reply(page)], ("tasks", "list")),
        ([json_reply({"webhooks": [hook]})], ("webhooks", "list")),
        ([json_reply(hook)], ("webhooks", "get", "wh1")),
        (
            [json_reply({"deliveries": [delivery], "next_cursor": None})],
            ("webhooks", "deliveries", "wh1"),
        ),
    ):
        status = run_reach(replies, *argv, monkeypatch=monkeypatch)
        out = capsys.readouterr().out
        assert status == 0, argv
        assert_literal(out)


def test_json_output_carries_no_c1_and_parses_to_what_the_server_sent(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    status = run_reach(
        [json_reply(FAILED)], "tasks", "get", "t1", "--json", monkeypatch=monkeypatch
    )
    out = capsys.readouterr().out
    assert status == 0
    assert "\x9b" not in out and "\x1b" not in out and "\x07" not in out
    assert json.loads(out) == FAILED


def test_a_problem_from_the_server_is_printed_as_text(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    problem = {"code": "task_not_found", "detail": HOSTILE, "errors": [{"msg": HOSTILE}]}
    answer = Reply(404, {"Content-Type": "application/problem+json"}, json.dumps(problem).encode())
    status = run_reach([answer], "tasks", "get", "t1", monkeypatch=monkeypatch)
    err = capsys.readouterr().err
    assert status == 6
    assert "\x1b" not in err and "\x9b" not in err and "\x07" not in err
    assert "task succeeded[0m [link=https://evil.example/]docs[/link] [/x] 31m" in err
