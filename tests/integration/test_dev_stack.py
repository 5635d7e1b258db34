"""``reach dev`` (what ``scripts/dev.py`` runs): it brings the stack up, prints a key and a curl
that works, and Ctrl-C stops everything it started."""

from __future__ import annotations

import contextlib
import fcntl
import functools
import json
import re
import secrets
import signal
import socket
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

Popen = subprocess.Popen[bytes]
REACH = str(Path(sys.executable).parent / "reach")
STARTUP_S = 90  # the whole stack, embedded Postgres and Redis included, on a slow machine


@pytest.fixture
def own_database(services: localservices.Services) -> Iterator[str]:
    name = f"reach_dev_{secrets.token_hex(4)}"
    yield localservices.create_database(services.database_url, name)
    localservices.drop_database(services.database_url, name)


@pytest.fixture
def missing_database(services: localservices.Services) -> Iterator[str]:
    """The URL of a database that does not exist (yet), dropped afterwards."""
    name = f"reach_dev_{secrets.token_hex(4)}"
    yield localservices.with_database(services.database_url, name)
    localservices.drop_database(services.database_url, name)


def _dev_environment(settings: Settings, database_url: str, redis_url: str) -> dict[str, str]:
    env = environment(settings)
    # Its own database and Redis db: no test worker may serve its tasks or hold its leases.
    env.update(DATABASE_URL=database_url, REDIS_URL=redis_url)
    for name in (
        "REACH_DATABASE_URL",
        "REACH_REDIS_URL",
        "REACH_AGENTS",
        "REACH_LEASE_TTL_S",
        "REACH_WEBHOOK_ALLOW",
    ):
        env.pop(name, None)
    return env


def _start_dev(env: dict[str, str], cwd: Path, log: Path, port: int, flower_port: int) -> Popen:
    with log.open("wb") as out:
        return subprocess.Popen(
            [REACH, "dev", "--port", str(port), "--flower-port", str(flower_port)],
            env=env,
            cwd=cwd,
            stdout=out,
            stderr=subprocess.STDOUT,
        )


def _banner(log: Path, dev: Popen) -> str:
    """The output up to the banner, or up to the command's end if it stopped before."""
    return eventually(
        lambda: log.read_text(errors="replace"),
        "the banner",
        STARTUP_S,
        0.2,
        until=lambda text: "Ctrl-C stops everything" in text or dev.poll() is not None,
    )


def _interrupt(dev: Popen) -> int:
    """Ctrl-C, as its user stops it: its exit code. A stack still running a minute later is
    killed, each of its processes, before the test fails: it ran on beside the rest of the
    suite, its workers and beat holding connections of the shared Postgres."""
    family: list[psutil.Process] = []
    with contextlib.suppress(psutil.NoSuchProcess):
        family = psutil.Process(dev.pid).children(recursive=True)
    dev.send_signal(signal.SIGINT)
    try:
        return dev.wait(timeout=60)
    except subprocess.TimeoutExpired:
        for process in family:
            with contextlib.suppress(psutil.NoSuchProcess):
                process.kill()
        dev.kill()
        dev.wait()
        raise


def _stop_dev(dev: Popen, log: Path) -> None:
    code = _interrupt(dev)
    assert code == 0, log.read_text(errors="replace")[-3000:]


@pytest.mark.timeout(240)
def test_the_printed_curl_submits_an_invoice_and_ctrl_c_stops_it_all(
    settings: Settings, tmp_path: Path, own_database: str, own_redis: str
) -> None:
    port, flower_port = free_port(), free_port()
    env = _dev_environment(settings, own_database, own_redis)
    log = tmp_path / "dev.log"
    dev = _start_dev(env, tmp_path, log, port, flower_port)
    try:
        banner = _banner(log, dev)
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
        code = _interrupt(dev)
    assert code == 0, log.read_text(errors="replace")[-3000:]
    _, alive = psutil.wait_procs(children, timeout=30)
    assert alive == []
    # and it said it was stopping them (it ended without a word before)
    assert "reach dev: stopping everything it started" in log.read_text(errors="replace")


@pytest.mark.timeout(360)
def test_a_taken_flower_port_leaves_the_stack_running_and_the_next_run_revokes_the_key(
    settings: Settings, tmp_path: Path, missing_database: str, own_redis: str
) -> None:
    """Given Flower's port taken and a DATABASE_URL naming no database yet: the stack comes up
    (the database created, one warning for Flower, each worker's metrics on a port of its
    own); a second run prints a new key and the first run's no longer opens the API."""
    port, flower_port, metrics_base = free_port(), free_port(), free_port(5)
    env = _dev_environment(settings, missing_database, own_redis)
    env["REACH_WORKER_METRICS_PORT"] = str(metrics_base)
    api = f"http://127.0.0.1:{port}"
    tokens = []
    with socket.socket() as flower_squatter:
        flower_squatter.bind(("127.0.0.1", flower_port))
        flower_squatter.listen()
        for run in (1, 2):
            log = tmp_path / f"dev{run}.log"
            dev = _start_dev(env, tmp_path, log, port, flower_port)
            try:
                banner = _banner(log, dev)
                assert "Traceback" not in banner, banner[-3000:]
                token = re.search(r"API key\s+(rk_\S+)", banner)
                assert token, banner[-3000:]
                tokens.append(token.group(1))
                output = eventually(
                    functools.partial(log.read_text, errors="replace"),
                    "Flower's warning",
                    STARTUP_S,
                    0.2,
                    until=lambda text: "flower exited" in text,
                )
                warnings = [ln for ln in output.splitlines() if "flower exited" in ln]
                assert len(warnings) == 1 and "the rest runs on" in warnings[0], output
                assert _status(f"{api}/capabilities", tokens[-1]) == 200
                if run == 1:
                    assert "created database" in banner
                    # maintenance and webhooks need not be ready with the agents' workers
                    for metrics_port in range(metrics_base, metrics_base + 5):
                        url = f"http://127.0.0.1:{metrics_port}/metrics"
                        eventually(functools.partial(_answers, url), url, STARTUP_S, 0.2)
                else:
                    assert _status(f"{api}/capabilities", tokens[0]) == 401
            finally:
                _stop_dev(dev, log)
    served = "".join(p.read_text() for p in (tmp_path / ".reach" / "logs").glob("*.log"))
    assert "worker metrics not served" not in served


def _status(url: str, token: str) -> int:
    return httpx.get(url, headers={"Authorization": f"Bearer {token}"}, timeout=10).status_code


def _answers(url: str) -> bool:
    try:
        return httpx.get(url, timeout=2).status_code == 200
    except httpx.HTTPError:
        return False


@pytest.mark.timeout(300)
def test_the_stack_runs_on_embedded_postgres_and_redis_as_on_a_machine_with_neither(
    settings: Settings, tmp_path: Path
) -> None:
    """The README's first command on a machine with only Python: every other test here (and
    CI's machine) has Postgres and Redis on their ports, which the stack prefers, so the
    embedded path was never run whole. ``REACH_EMBEDDED=1`` takes it wherever."""
    port, flower_port = free_port(), free_port()
    env = _dev_environment(settings, "", "")
    for name in ("DATABASE_URL", "REDIS_URL"):
        env.pop(name)
    env["REACH_EMBEDDED"] = "1"
    log = tmp_path / "dev.log"
    dev = _start_dev(env, tmp_path, log, port, flower_port)
    try:
        banner = _banner(log, dev)
        assert "Agent-Reach is running (embedded postgres, redis)" in banner, banner
        token = re.search(r"API key\s+(rk_\S+)", banner)
        assert token, banner
        headers = {"Authorization": f"Bearer {token.group(1)}"}
        api = f"http://127.0.0.1:{port}"
        invoice = {"text": "ACME\nInvoice No: INV-7\nDate: 2024-03-15\nTotal: USD 10.00"}
        envelope = {"capability": "invoice.extract", "payload": invoice, "reply_mode": "sync"}
        answer = httpx.post(f"{api}/tasks", json=envelope, headers=headers, timeout=60)
        assert answer.status_code == 200, answer.text
        assert answer.json()["result"]["number"] == "INV-7"
        children = psutil.Process(dev.pid).children(recursive=True)
        assert _running_from(tmp_path)  # the embedded servers, their data in the run's folder
    finally:
        code = _interrupt(dev)
    assert code == 0, log.read_text(errors="replace")[-3000:]
    # And nothing it started is left, the embedded Postgres and Redis included
    _, alive = psutil.wait_procs(children, timeout=30)
    assert alive == []
    assert (tmp_path / ".reach" / "postgres").is_dir()
    eventually(lambda: _running_from(tmp_path), "the embedded services stopped", until=[].__eq__)


def _running_from(folder: Path) -> list[str]:
    """The processes whose command line names ``folder`` (an embedded server's data there)."""
    found = []
    for process in psutil.process_iter(["cmdline"]):
        command = " ".join(process.info["cmdline"] or [])
        if str(folder) in command:
            found.append(command)
    return found


def test_a_second_run_from_the_same_folder_is_refused_while_the_first_runs(
    tmp_path: Path,
) -> None:
    """On other ports it started beside the first, revoked the key the first had printed and
    wrote its logs over the first's. The folder's lock stands for a first run here: refused
    before anything starts, naming the holder; let go, the folder is free again."""
    data_dir = tmp_path / ".reach"
    data_dir.mkdir()
    with (data_dir / "dev.lock").open("a+") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        lock.write("4242")
        lock.flush()
        second = subprocess.run(
            [REACH, "dev", "--port", str(free_port()), "--flower-port", str(free_port())],
            cwd=tmp_path,
            capture_output=True,
            text=True,
            timeout=60,
        )
    assert second.returncode == 1, second.stderr
    assert second.stderr.strip() == (
        f"reach dev: another reach dev runs from {tmp_path} (pid 4242): stop it first, "
        "or run this one from another folder"
    )
    assert not (data_dir / "logs" / "api.log").exists()
    with (data_dir / "dev.lock").open("a+") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)  # not held by the refused run
