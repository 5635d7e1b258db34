"""The operator's commands when Postgres does not answer for the database named: one line
saying so and exit status 7, as the user's commands say of an API out of reach."""

from __future__ import annotations

import secrets
import subprocess
import sys
from pathlib import Path

import pytest

from broker.settings import Settings
from reach import localservices
from tests.integration.stack import environment

REACH = str(Path(sys.executable).parent / "reach")
UNREACHABLE = 7


@pytest.mark.parametrize("command", [["migrate"], ["keys", "list"]])
def test_an_operator_command_on_a_database_that_does_not_exist_says_so_in_one_line(
    settings: Settings, services: localservices.Services, command: list[str]
) -> None:
    missing = f"reach_none_{secrets.token_hex(4)}"
    url = localservices.with_database(services.database_url, missing)
    env = environment(settings.model_copy(update={"database_url": url}))

    done = subprocess.run([REACH, *command], env=env, capture_output=True, text=True, timeout=60)

    assert done.returncode == UNREACHABLE, done.stderr
    assert done.stderr.splitlines() == [done.stderr.strip()], done.stderr
    assert done.stderr.startswith(f"reach: cannot connect to {url}: "), done.stderr
    assert f'database "{missing}" does not exist' in done.stderr
