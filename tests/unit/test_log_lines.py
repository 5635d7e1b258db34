"""One log record, one line: a tenant's text quoted in a log line (a request's path, an agent's
error) cannot make a line of its own, nor reach the operator's terminal as an escape."""

from __future__ import annotations

import json
import logging
import sys

import pytest

from broker.observability.logs import JsonFormatter, TextFormatter, bound, capture_context

# A request's path as uvicorn decodes it (``/tasks/%0A12:00:00%20ERROR...``), quoted by the
# API's 503 line: a forged line of the broker's, then a terminal's clear-screen.
FORGED = "/tasks/x\n12:00:00 ERROR   reach.api: all keys revoked  [trace_id=deadbeef]\x1b[2J"


def _record(*args: object) -> logging.LogRecord:
    capture_context()
    return logging.LogRecord("reach.api", logging.WARNING, __file__, 1, "503 on %s: %s", args, None)


def test_a_text_line_shows_line_ends_and_escapes_escaped() -> None:
    with bound(capability="a\rb"):
        line = TextFormatter().format(_record(FORGED, "tab\tkept"))
    assert line.splitlines() == [line]
    assert "\x1b" not in line
    assert "/tasks/x\\n12:00:00 ERROR" in line
    assert "\\u001b[2J" in line
    assert "tab\tkept" in line
    assert "capability=a\\rb" in line


@pytest.mark.parametrize("char", ["\u2028", "\u2029", "\x85", "\x9b", "\x7f"])
def test_a_json_line_escapes_what_readers_take_for_line_ends_or_escapes(char: str) -> None:
    """``json.dumps`` escapes C0 itself, and writes these raw: ``str.splitlines`` split one
    record in three at U+2028 and U+0085, and U+009B is a terminal's escape."""
    line = JsonFormatter().format(_record(f'/tasks/a{char}{{"level": "error"}}', "x"))
    assert line.splitlines() == [line]
    assert char not in line
    assert json.loads(line)["message"] == f'503 on /tasks/a{char}{{"level": "error"}}: x'


def test_text_that_needs_no_escape_is_written_as_it_is() -> None:
    """Non-ASCII text stays readable, in both."""
    record = _record("/tasks/发票", "ünïcode")
    assert "/tasks/发票: ünïcode" in TextFormatter().format(record)
    assert json.loads(JsonFormatter().format(record))["message"] == "503 on /tasks/发票: ünïcode"
    assert "发票" in JsonFormatter().format(record)


def test_a_tracebacks_lines_come_indented_below_the_record_whatever_its_text_holds() -> None:
    """The traceback's last line quotes the exception's text (an agent's error), which may
    hold a line end: it began a line that read as a record of its own."""
    try:
        raise RuntimeError("boom\n12:00:00 ERROR   reach.api: forged  [trace_id=beef]")
    except RuntimeError:
        record = _record("/x", "y")
        record.exc_info = sys.exc_info()
    first, *rest = TextFormatter().format(record).split("\n")
    assert first.endswith("503 on /x: y")
    assert rest and all(line.startswith("    ") for line in rest)
    assert rest[0] == "    Traceback (most recent call last):"
    assert rest[-2:] == [
        "    RuntimeError: boom",
        "    12:00:00 ERROR   reach.api: forged  [trace_id=beef]",
    ]
