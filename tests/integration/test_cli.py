"""``reach keys`` and ``reach migrate`` as an operator runs them, in a subprocess."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import httpx
import pytest
from sqlalchemy import Engine, select

from broker.db.models import api_keys_table
from broker.settings import Settings
from tests.integration.stack import ServedApp, environment

REACH = str(Path(sys.executable).parent / "reach")


def reach(settings: Settings, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [REACH, *args], env=environment(settings), capture_output=True, text=True, timeout=60
    )


def test_created_key_works_until_revoked(settings: Settings, uncached_api: ServedApp) -> None:
    api = uncached_api
    created = reach(
        settings,
        "keys",
        "create",
        "--tenant",
        "cli-co",
        "--capabilities",
        "invoice.*, echo",
        "--name",
        "ci",
    )
    assert created.returncode == 0, created.stderr
    token = re.search(r"api key: (\S+)", created.stdout)
    key_id = re.search(r"key_id:\s+(\S+)", created.stdout)
    assert token and key_id
    headers = {"Authorization": f"Bearer {token.group(1)}"}

    listed = [
        json.loads(line)
        for line in reach(settings, "keys", "list", "--tenant", "cli-co").stdout.splitlines()
    ]
    assert [k["key_id"] for k in listed] == [key_id.group(1)]
    assert listed[0]["capabilities"] == ["invoice.*", "echo"]
    assert token.group(1) not in json.dumps(listed)  # the secret is never shown again

    assert httpx.get(f"{api.url}/tasks", headers=headers).status_code == 200
    assert reach(settings, "keys", "revoke", key_id.group(1)).returncode == 0
    assert httpx.get(f"{api.url}/tasks", headers=headers).status_code == 401
    again = reach(settings, "keys", "revoke", key_id.group(1))
    assert again.returncode == 2  # no active key: a usage error (1 is a task that failed)


def test_a_tenant_admin_key_is_listed_as_such_and_sets_the_callback_secret(
    settings: Settings, api: ServedApp
) -> None:
    def create(*flags: str) -> str:
        args = ["keys", "create", "--tenant", "cli-admin", "--capabilities", "echo", *flags]
        created = reach(settings, *args)
        assert created.returncode == 0, created.stderr
        found = re.search(r"api key: (\S+)", created.stdout)
        assert found
        return found.group(1)

    plain, manager = create(), create("--tenant-admin")
    listed = reach(settings, "keys", "list", "--tenant", "cli-admin").stdout.splitlines()

    assert [json.loads(line)["tenant_admin"] for line in listed] == [False, True]
    for token, status in ((plain, 403), (manager, 201)):
        headers = {"Authorization": f"Bearer {token}"}
        assert httpx.post(f"{api.url}/callbacks/secret", headers=headers).status_code == status


def test_a_bad_pattern_is_refused(settings: Settings) -> None:
    result = reach(settings, "keys", "create", "--tenant", "x", "--capabilities", "Bad Pattern")
    assert result.returncode == 2
    assert "invalid_pattern" in result.stderr


@pytest.mark.parametrize(
    ("flags", "code"),
    [
        (["--tenant", "cli-long-name", "--name", "n" * 129], "invalid_name"),
        (["--tenant", "cli-long-name", "--name", "ops\x1b[31m"], "invalid_name"),
        (["--tenant", "t" * 65], "invalid_tenant"),
        (["--tenant", "cli\tbad"], "invalid_tenant"),
    ],
    ids=["name too long", "name with a control character", "tenant too long", "tenant tab"],
)
def test_a_name_or_tenant_the_key_table_cannot_hold_is_refused_in_one_line(
    settings: Settings, engine: Engine, flags: list[str], code: str
) -> None:
    # When a key is asked for with a name or tenant past what the table holds
    result = reach(settings, "keys", "create", "--capabilities", "echo", *flags)
    # Then it is refused as a bad pattern is (2, its code), with no traceback (which printed
    # the new key's hash and every value of the insert), and no key made
    assert result.returncode == 2, result.stderr
    assert f"({code})" in result.stderr and "Traceback" not in result.stderr, result.stderr
    with engine.connect() as conn:
        made = conn.execute(
            select(api_keys_table.c.key_id).where(api_keys_table.c.tenant == flags[1])
        ).all()
    assert made == []


def test_migrate_is_idempotent(settings: Settings) -> None:
    result = reach(settings, "migrate")
    assert result.returncode == 0, result.stderr
    assert "migrated to head" in result.stdout
