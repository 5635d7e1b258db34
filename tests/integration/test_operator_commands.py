"""The operator's commands (``reach keys``, ``reach migrate``) against the real database: the
answers a script reads (``--json``, exit statuses), and what a bad URL or id gets."""

from __future__ import annotations

import json
import subprocess
import sys
import uuid
from datetime import datetime
from pathlib import Path

import pytest
from reach_client.cli import exits

from broker.settings import Settings
from tests.integration.stack import environment

REACH = str(Path(sys.executable).parent / "reach")


def reach(settings: Settings, *argv: str) -> subprocess.CompletedProcess[str]:
    env = environment(settings)
    return subprocess.run([REACH, *argv], env=env, capture_output=True, text=True, timeout=60)


@pytest.mark.parametrize("where", ["before", "after"])
def test_keys_answer_json_a_script_reads_with_json_given_before_or_after_the_command(
    settings: Settings, where: str
) -> None:
    """``--json`` before the command was taken and ignored (plain text came out); after it,
    refused. A key list's times were Python's (``2026-12-07 20:41:40+00:00``), not ISO 8601."""
    tenant = f"ops-json-{uuid.uuid4().hex[:6]}"

    def run(*argv: str) -> subprocess.CompletedProcess[str]:
        given = ["--json", *argv] if where == "before" else [*argv, "--json"]
        return reach(settings, *given)

    made = run("keys", "create", "--tenant", tenant, "--capabilities", "echo,invoice.*")
    assert made.returncode == exits.OK, made.stderr
    key = json.loads(made.stdout)
    assert (key["tenant"], key["capabilities"], key["kind"]) == (
        tenant,
        ["echo", "invoice.*"],
        "tenant",
    )
    assert key["api_key"].startswith("rk_")
    listed = run("keys", "list", "--tenant", tenant)
    (row,) = json.loads(listed.stdout)
    assert row["key_id"] == key["key_id"] and "api_key" not in row
    assert datetime.fromisoformat(row["created_at"]).tzinfo is not None
    assert "T" in row["created_at"]
    revoked = run("keys", "revoke", key["key_id"])
    assert json.loads(revoked.stdout) == {"revoked": key["key_id"]}
    migrated = run("migrate")
    assert json.loads(migrated.stdout) == {"migrated": "head"}, migrated.stderr


def test_revoking_a_key_that_is_not_active_is_a_usage_error(settings: Settings) -> None:
    """It exited 1, which ``reach`` says of a task that failed."""
    done = reach(settings, "keys", "revoke", "no-such-key")
    assert done.returncode == exits.USAGE
    assert done.stderr.strip() == "reach: no active key no-such-key"


@pytest.mark.parametrize(
    ("tenant", "capabilities", "said"),
    [
        (" ", "echo", "no white space at either end"),
        ("acme ", "echo", "no white space at either end"),
        ("acme", ",", "at least one capability pattern"),
    ],
)
def test_a_tenant_no_key_should_have_or_no_pattern_is_refused(
    settings: Settings, tenant: str, capabilities: str, said: str
) -> None:
    done = reach(settings, "keys", "create", "--tenant", tenant, "--capabilities", capabilities)
    assert done.returncode == exits.USAGE, done.stdout
    assert said in done.stderr and "Traceback" not in done.stderr


def test_an_option_of_the_database_url_libpq_refuses_is_one_line(settings: Settings) -> None:
    """``?connect_timeout=abc`` was a traceback (psycopg's ProgrammingError)."""
    url = settings.database_url + ("&" if "?" in settings.database_url else "?")
    bad = settings.model_copy(update={"database_url": url + "connect_timeout=abc"})
    done = reach(bad, "keys", "list")
    assert done.returncode == exits.USAGE
    assert done.stderr.strip() == "reach: REACH_DATABASE_URL: bad value for connect_timeout: 'abc'"


@pytest.mark.parametrize("command", ["api", "dev"])
@pytest.mark.parametrize("port", ["99999", "-1", "0", "http"])
def test_a_port_out_of_range_is_refused_before_anything_starts(
    settings: Settings, command: str, port: str
) -> None:
    """99999 was taken modulo 65536 by uvicorn (it listened on 34463 and said 99999); -1 was
    a traceback."""
    done = reach(settings, command, "--port", port)
    assert done.returncode == exits.USAGE
    assert "--port" in done.stderr and "Traceback" not in done.stderr
