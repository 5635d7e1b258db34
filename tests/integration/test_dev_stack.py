"""``reach dev`` (what ``scripts/dev.py`` runs): it brings the stack up, prints a key and a curl
that works, and Ctrl-C stops everything it started."""

from __future__ import annotations

import json
import re
import secrets
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import httpx
import psutil
import pytest

from broker.settings import Settings
from reach import localservices
from tests.eventually import eventually
from tests.integration.stack import environment, free_port

REACH = str(Path(sys.executable).parent / "reach")
STARTUP_S = 90  # the whole stack, embedded Postgres and Redis included, on a slow machine


@pytest.fixture
def own_database(services: localservices.Services) -> Iterator[str]:
    name = f"reach_dev_{secrets.token_hex(4)}"
    yield localservices.create_database(services.database_url, name)
    localservices.drop_database(services.database_url, name)


@pytest.mark.timeout(240)
def test_the_printed_curl_submits_an_invoice_and_ctrl_c_stops_it_all(
    settings: Settings, tmp_path: Path, own_database: str, own_redis: str
) -> None:
    port, flower_port = free_port(), free_port()
    env = environment(settings)
    # Its own database and Redis db: no test worker may serve its tasks or hold its leases.
    env.update(DATABASE_URL=own_database, REDIS_URL=own_redis)
    for name in (
        "REACH_DATABASE_URL",
        "REACH_REDIS_URL",
        "REACH_AGENTS",
        "REACH_LEASE_TTL_S",
        "REACH_WEBHOOK_ALLOW",
    ):
        env.pop(name, None)
    log = tmp_path / "dev.log"
    with log.open("wb") as out:
        dev = subprocess.Popen(
            [REACH, "dev", "--port", str(port), "--flower-port", str(flower_port)],
            env=env,
            cwd=tmp_path,
            stdout=out,
            stderr=subprocess.STDOUT,
        )
    try:
        banner = eventually(
            lambda: log.read_text(errors="replace"),
            "the banner",
            STARTUP_S,
            0.2,
            until=lambda text: "Ctrl-C stops everything" in text,
        )
        submit = re.search(r"^\s*(curl -s \S+/tasks -H .*?)\n(?=Poll)", banner, re.M | re.S)
        poll = re.search(r"^\s*(curl -s \S+/tasks/TASK_ID .*)$", banner, re.M)
        assert submit and poll, banner
        # The dev stack lets webhooks reach loopback, and says so.
        assert "REACH_WEBHOOK_ALLOW=127.0.0.0/8,::1,localhost" in banner
        accepted = subprocess.run(
            ["bash", "-c", submit.group(1)], capture_output=True, text=True, timeout=30
        )
        task_id = json.loads(accepted.stdout)["task_id"]

        def finished() -> dict[str, object] | None:
            command = poll.group(1).replace("TASK_ID", task_id)
            out = subprocess.run(["bash", "-c", command], capture_output=True, text=True)
            task: dict[str, object] = json.loads(out.stdout)
            return task if task["status"] in ("succeeded", "failed") else None

        task = eventually(finished, "the invoice task", STARTUP_S, 0.2)
        assert task["status"] == "succeeded", task
        assert task["agent"]["instance"].startswith("dev@")
        assert task["result"] == {
            "number": "INV-2024-0042",
            "date": "2024-03-15",
            "total": "1024.00",
            "currency": "CNY",
            "seller": "ACME Trading Co.",
        }
        assert httpx.get(f"http://127.0.0.1:{port}/docs").status_code == 200
        # The printed key manages its tenant: the README's webhook examples start here.
        token = re.search(r"API key\s+(rk_\S+)", banner)
        assert token, banner
        headers = {"Authorization": f"Bearer {token.group(1)}"}
        secret = httpx.post(f"http://127.0.0.1:{port}/callbacks/secret", headers=headers)
        assert secret.status_code == 201, secret.text
        eventually(lambda: _answers(f"http://127.0.0.1:{flower_port}/"), "flower", STARTUP_S, 0.2)
        children = psutil.Process(dev.pid).children(recursive=True)
        assert len(children) >= 4  # api, worker (and its pool), beat, flower
    finally:
        dev.send_signal(signal.SIGINT)
        code = dev.wait(timeout=60)
    assert code == 0, log.read_text(errors="replace")[-3000:]
    _, alive = psutil.wait_procs(children, timeout=30)
    assert alive == []


def _answers(url: str) -> bool:
    try:
        return httpx.get(url, timeout=2).status_code == 200
    except httpx.HTTPError:
        return False
