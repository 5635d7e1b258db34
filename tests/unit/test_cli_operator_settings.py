"""The operator's commands with a setting they cannot run with: a line naming each variable
and what is wrong with it, exit status 2, and no traceback."""

from __future__ import annotations

import pytest

from reach.cli import main

USAGE = 2


@pytest.mark.parametrize("command", [["migrate"], ["api"], ["dev"], ["keys", "list"]])
def test_a_refused_setting_is_named_in_one_line_each_with_exit_status_2(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], command: list[str]
) -> None:
    # Given settings that refuse three variables (one read as DATABASE_URL)
    for name in ("REACH_DATABASE_URL", "REACH_BROKER_URL"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("DATABASE_URL", "mysql://app:secret@db/reach")
    monkeypatch.setenv("REACH_RESULT_TTL_S", "-1")
    monkeypatch.setenv("REACH_WEBHOOK_SCHEDULE_S", "0,nan")
    # When an operator command is run (before: a pydantic ValidationError traceback)
    status = main(command)
    # Then each is named, with why, and nothing else is said
    assert status == USAGE
    assert capsys.readouterr().err.splitlines() == [
        "error: REACH_DATABASE_URL or DATABASE_URL: not a PostgreSQL URL (scheme mysql://):"
        " postgresql+psycopg://user@host/db, or postgresql:// or postgres://",
        "error: REACH_RESULT_TTL_S: Input should be greater than 0",
        "error: REACH_WEBHOOK_SCHEDULE_S (entry 2): Input should be a finite number",
    ]
