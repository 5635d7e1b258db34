"""``reach dev``: the whole stack on one machine, for trying it out.

Uses ``REACH_DATABASE_URL``/``DATABASE_URL`` and ``REACH_REDIS_URL``/``REDIS_URL`` when set,
the services on the standard local ports when they answer (not with ``REACH_EMBEDDED=1``),
and otherwise starts an embedded Postgres and Redis under ``.reach/``; a database the URL
names that does not exist yet is created. Each process writes its output to
``.reach/logs/<name>.log``. Each run prints a fresh operator key and revokes the one the
previous run printed. Ctrl-C stops everything it started.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import IO
from urllib.parse import urlsplit

import httpx
import psycopg
from sqlalchemy import Engine

from broker.db.engines import sync_engine
from broker.settings import Settings, psycopg_url
from broker.tasks.dispatch import MAINTENANCE_QUEUE, WEBHOOKS_QUEUE
from broker.tenancy import key_store
from reach import localservices, migrate
from reach.cli import API_STOP_TIMEOUT_S

DATA_DIR = Path(".reach")
DEV_TENANT = "dev"
DEV_KEY_NAME = "reach dev"  # marks the keys this command printed: the next run revokes them
OPTIONAL = frozenset({"flower"})  # the stack is whole without these; they only warn when they stop
# Each worker serves its own /metrics: from REACH_WORKER_METRICS_PORT up, one port each.
ERROR_LINE = re.compile(r"error|exception|fatal|refused|denied", re.IGNORECASE)
WORKERS = ("worker", "async-worker", "bridge", "maintenance", "webhooks")
CAPABILITY_QUEUES = "echo,invoice.extract,text.summarize,chat.reply"
ASYNC_QUEUES = "llm.complete"  # async agents: one process on the threads pool
DEMO_STREAM = (
    '{"capability": "llm.complete", "reply_mode": "stream",'
    ' "payload": {"prompt": "hello from an async agent", "stream": true}}'
)
DEMO_REMOTE = (
    '{"version": "1.0.0", "endpoint": {"protocol": "http", "url": "http://127.0.0.1:9000/run"},'
    ' "capabilities": [{"capability": "text.upper", "streaming": true, "idempotent": true}]}'
)
DEV_WEBHOOK_ALLOW = "127.0.0.0/8,::1,localhost"
DEMO_INVOICE = (
    "ACME Trading Co.\\nInvoice No: INV-2024-0042\\nDate: 2024-03-15\\nTotal: CNY 1,024.00"
)


def _environment(data_dir: Path) -> tuple[dict[str, str], localservices.Services]:
    env = dict(os.environ)
    given_database_url = env.get("REACH_DATABASE_URL") or env.get("DATABASE_URL")
    services = localservices.ensure_services(
        data_dir,
        database_url=given_database_url and psycopg_url(given_database_url),
        redis_url=env.get("REACH_REDIS_URL") or env.get("REDIS_URL"),
        # The embedded ones even where Postgres and Redis run on their usual ports: a stack
        # of its own, and the path of a machine with neither.
        prefer_local=env.get("REACH_EMBEDDED", "").lower() not in ("1", "true", "yes"),
    )
    database_url = services.database_url
    if given_database_url:
        _ensure_database(database_url)
    else:
        database_url = localservices.create_database(database_url, "reach", exist_ok=True)
    env.update(REACH_DATABASE_URL=database_url, REACH_REDIS_URL=services.redis_url)
    # Webhooks to a receiver on this machine: the deny table refuses loopback otherwise.
    env.setdefault("REACH_WEBHOOK_ALLOW", DEV_WEBHOOK_ALLOW)
    # The API listens on loopback here: /metrics needs no token (elsewhere it does).
    env.setdefault("REACH_METRICS_PUBLIC", "true")
    # llm.complete calls the stand-in model the stack runs, unless a real one is named.
    env.setdefault("REACH_MODEL_URL", f"http://127.0.0.1:{_free_port()}")
    return env, services


def _ensure_database(url: str) -> None:
    """Create the database ``url`` names when its server says there is none (and lets us)."""
    name = urlsplit(url).path.lstrip("/")
    try:
        psycopg.connect(localservices.libpq_url(url), connect_timeout=10).close()
    except psycopg.OperationalError as exc:
        if not name or f'database "{name}" does not exist' not in str(exc):
            raise
        try:
            localservices.create_database(
                localservices.with_database(url, "postgres"), name, exist_ok=True
            )
        except psycopg.Error as refused:
            raise psycopg.OperationalError(f"{exc}; creating it failed: {refused}") from refused
        print(f"reach dev: created database {name!r}", file=sys.stderr, flush=True)


def worker_metrics_ports(base: int) -> dict[str, int]:
    """Each worker's REACH_WORKER_METRICS_PORT: ``base``, ``base + 1``, ...; 0 leaves all off.
    Processes on one host cannot share a port: all but the first would serve nothing."""
    return {name: base + i if base else 0 for i, name in enumerate(WORKERS)}


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _check_api_port(port: int) -> None:
    """Refuse a taken API port before anything starts: another stack's API there would answer
    this run's readiness probe (Flower's port only warns later: the stack runs without it)."""
    with socket.socket() as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn binds
        try:
            sock.bind(("127.0.0.1", port))
        except OSError as exc:
            raise StackError(
                f"port {port} is taken ({exc.strerror}), perhaps by another reach dev: "
                "stop it, or choose another port with --port"
            ) from exc


def _commands(port: int, flower_port: int, data_dir: Path, model_url: str) -> dict[str, list[str]]:
    bin_dir = Path(sys.executable).parent
    celery = [str(bin_dir / "celery"), "-A", "workers"]
    model_port = urlsplit(model_url).port or 80
    return {
        "api": [
            str(bin_dir / "uvicorn"),
            "api.app:create_app_from_env",
            "--factory",
            "--http",
            "api.connections:Protocol",
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            "--no-access-log",
            "--timeout-graceful-shutdown",
            str(API_STOP_TIMEOUT_S),  # as `reach api` has it: within _stop's wait
        ],
        # A worker each: agents, maintenance and deliveries never wait behind one another.
        "worker": _worker(celery, CAPABILITY_QUEUES, "dev", 2),
        "async-worker": [*_worker(celery, ASYNC_QUEUES, "async", 100), "-P", "threads"],
        "model": [str(bin_dir / "python"), "-m", "reach.fakemodel", f"--port={model_port}"],
        # Remote agents (PUT /agents/{agent_id}): called from one process, many at once.
        "bridge": [
            str(bin_dir / "celery"),
            "-A",
            "workers.bridge",
            "worker",
            "-n",
            "bridge@%h",
            "-P",
            "threads",
            "-c",
            "100",
            "-l",
            "INFO",
        ],
        "maintenance": _worker(celery, MAINTENANCE_QUEUE, "maintenance", 2),
        # More processes than one tenant may hold (REACH_WEBHOOK_MAX_INFLIGHT_PER_TENANT, 4).
        "webhooks": _worker(celery, WEBHOOKS_QUEUE, "webhooks", 6),
        "beat": [
            *celery,
            "beat",
            "-l",
            "INFO",
            "--schedule",
            str(data_dir / "celerybeat-schedule"),
        ],
        "flower": [*celery, "flower", f"--port={flower_port}", "--address=127.0.0.1"],
    }


def _worker(celery: list[str], queues: str, name: str, concurrency: int) -> list[str]:
    node = f"{name}@%h"
    return [*celery, "worker", "-Q", queues, "-n", node, "-c", str(concurrency), "-l", "INFO"]


class StackError(Exception):
    """The stack cannot run; its message is one line for the terminal."""


def exit_message(name: str, code: int | None, log: Path) -> str:
    """One line: which process stopped, its status, the error its log ends with and where
    the rest of it is."""
    error = last_error(log)
    return f"{name} exited with {code}" + (f": {error}" if error else "") + f" (log: {log})"


def last_error(log: Path, tail_bytes: int = 8192, most_chars: int = 300) -> str:
    """The last line of ``log`` that tells of an error, else its last line."""
    try:
        with log.open("rb") as file:
            file.seek(max(0, file.seek(0, os.SEEK_END) - tail_bytes))
            lines = [ln.strip() for ln in file.read().decode(errors="replace").splitlines()]
    except OSError:
        return ""
    lines = [ln for ln in lines if ln]
    errors = [ln for ln in lines if ERROR_LINE.search(ln)]
    return (errors or lines or [""])[-1][:most_chars]


def _check_children(processes: dict[str, subprocess.Popen[bytes]], logs: Path) -> None:
    """Raise for a stopped process the stack needs; warn once for an optional one (Flower on
    a taken port) and stop watching it."""
    for name, proc in list(processes.items()):
        if proc.poll() is None:
            continue
        message = exit_message(name, proc.returncode, logs / f"{name}.log")
        if name not in OPTIONAL:
            raise StackError(message)
        print(f"reach dev: warning: {message}; the rest runs on", file=sys.stderr, flush=True)
        del processes[name]


def _wait_ready(
    api: str,
    token: str,
    processes: dict[str, subprocess.Popen[bytes]],
    logs: Path,
    timeout_s: float,
) -> None:
    """Until this run's API listens and answers, and every example capability has a live
    agent, so the printed curl works the moment it is shown. Another API on the port would
    answer too: an answer counts only once our uvicorn has said it listens."""
    deadline = time.monotonic() + timeout_s
    wanted = {*CAPABILITY_QUEUES.split(","), *ASYNC_QUEUES.split(",")}
    while time.monotonic() < deadline:
        _check_children(processes, logs)
        if _listening(logs / "api.log") and wanted <= _live_capabilities(api, token):
            return
        time.sleep(0.3)
    raise StackError(f"{api} not ready with live agents after {timeout_s:.0f} s (logs: {logs})")


def _listening(api_log: Path) -> bool:
    """Whether uvicorn has said it listens, which it does only once it has its port."""
    try:
        return "Uvicorn running on" in api_log.read_text(errors="replace")
    except OSError:
        return False


def _live_capabilities(api: str, token: str) -> set[str]:
    try:
        response = httpx.get(
            f"{api}/capabilities", timeout=2, headers={"Authorization": f"Bearer {token}"}
        )
        if response.status_code != 200:
            return set()
        return {c["capability"] for c in response.json()["capabilities"] if c["live_instances"]}
    except httpx.HTTPError:
        return set()


def _hold(data_dir: Path) -> IO[str]:
    """The folder's lock (``dev.lock``), held until this process ends, however it ends: a
    second run from the same folder on other ports started beside the first, and took it
    over, revoking the key the first had printed and writing its logs over the first's.
    The lock names its holder's pid."""
    lock = (data_dir / "dev.lock").open("a+")
    try:
        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        lock.seek(0)
        holder = lock.read().strip() or "unknown"
        lock.close()
        raise StackError(
            f"another reach dev runs from {data_dir.parent} (pid {holder}): stop it first, "
            "or run this one from another folder"
        ) from None
    lock.seek(0)
    lock.truncate()
    lock.write(str(os.getpid()))
    lock.flush()
    return lock


def _create_dev_key(engine: Engine) -> tuple[str, str]:
    return key_store.create_key(
        engine, DEV_TENANT, ["*"], is_admin=True, tenant_admin=True, name=DEV_KEY_NAME
    )


def earlier_dev_keys(rows: list[dict[str, object]], current: str) -> list[str]:
    """The ids of the live keys earlier runs printed (``current`` is this run's)."""
    return [
        str(row["key_id"])
        for row in rows
        if row["tenant"] == DEV_TENANT
        and row["name"] == DEV_KEY_NAME
        and row["revoked_at"] is None
        and row["key_id"] != current
    ]


def _revoke_earlier_dev_keys(engine: Engine, current: str) -> None:
    for key_id in earlier_dev_keys(key_store.list_keys(engine, DEV_TENANT), current):
        key_store.revoke_key(engine, key_id)


def _banner(
    port: int,
    flower: str,
    token: str,
    services: localservices.Services,
    allow: str,
    logs: Path,
    metrics_ports: dict[str, int],
) -> str:
    api = f"http://127.0.0.1:{port}"
    metrics = (
        ", ".join(f"{n} :{p}" for n, p in metrics_ports.items())
        if any(metrics_ports.values())
        else "(off: REACH_WORKER_METRICS_PORT=0)"
    )
    where = f"embedded {', '.join(services.embedded)}" if services.embedded else "local services"
    return f"""
Agent-Reach is running ({where}).
  API      {api}        docs {api}/docs
  Flower   {flower}
  Metrics  {api}/metrics, the workers' on {metrics}
  Logs     {logs}/<process>.log
  API key  {token}
           tenant "dev", operator and tenant admin: it sets the callback secret too;
           the next run revokes it and prints another
  Webhooks REACH_WEBHOOK_ALLOW={allow or "(none)"}
           the SSRF guard lets webhooks reach these (loopback by default in dev;
           production allows none)

Submit an invoice:
  curl -s {api}/tasks -H "Authorization: Bearer {token}" -H 'Content-Type: application/json' \\
    -d '{{"capability": "invoice.extract", "payload": {{"text": "{DEMO_INVOICE}"}}}}'
Poll it (the task_id from above):
  curl -s {api}/tasks/TASK_ID -H "Authorization: Bearer {token}"
Stream an async agent's tokens (llm.complete, on a stand-in model at REACH_MODEL_URL):
  curl -sN {api}/tasks -H "Authorization: Bearer {token}" -H 'Content-Type: application/json' \\
    -d '{DEMO_STREAM}'
Reach an agent written in any language (see examples/agents/node/README.md):
  curl -s -X PUT {api}/agents/node-upper -H "Authorization: Bearer {token}" \\
    -H 'Content-Type: application/json' -d '{DEMO_REMOTE}'

Ctrl-C stops everything.
"""


def run_dev_stack(*, port: int = 8000, flower_port: int = 5555) -> int:
    # Ctrl-C, SIGTERM and SIGHUP (its terminal closed) stop the stack from the first moment,
    # even when started from a shell that made background jobs ignore SIGINT. The children,
    # in process groups of their own, get none of these from the terminal.
    signal.signal(signal.SIGINT, signal.default_int_handler)
    signal.signal(signal.SIGTERM, _interrupt)
    signal.signal(signal.SIGHUP, _interrupt)
    data_dir = DATA_DIR.resolve()
    logs = data_dir / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    processes: dict[str, subprocess.Popen[bytes]] = {}
    services: localservices.Services | None = None
    key_id = None
    ready = False
    lock: IO[str] | None = None
    try:
        lock = _hold(data_dir)
        _check_api_port(port)
        env, services = _environment(data_dir)
        migrate.upgrade(env["REACH_DATABASE_URL"])
        settings = Settings(
            database_url=env["REACH_DATABASE_URL"], redis_url=env["REACH_REDIS_URL"]
        )
        engine = sync_engine(settings)
        # The readiness probe needs a key; a run that never gets ready revokes it below.
        key_id, token = _create_dev_key(engine)
        commands = _commands(port, flower_port, data_dir, env["REACH_MODEL_URL"])
        metrics_ports = worker_metrics_ports(settings.worker_metrics_port)
        for name, command in commands.items():
            own_env = {**env, "REACH_WORKER_METRICS_PORT": str(metrics_ports.get(name, 0))}
            processes[name] = _start(command, own_env, logs / f"{name}.log")
        print(f"reach dev: starting; each process logs to {logs}/<name>.log", flush=True)
        _wait_ready(f"http://127.0.0.1:{port}", token, processes, logs, timeout_s=90)
        ready = True
        _revoke_earlier_dev_keys(engine, key_id)
        flower = f"http://127.0.0.1:{flower_port}" if "flower" in processes else "(not running)"
        allow = env["REACH_WEBHOOK_ALLOW"]
        banner = _banner(port, flower, token, services, allow, logs, metrics_ports)
        print(banner, flush=True)
        while True:
            _check_children(processes, logs)
            time.sleep(0.5)
    except (StackError, localservices.EmbeddedUnavailable) as exc:
        print(f"reach dev: {exc}", file=sys.stderr, flush=True)
        return 1
    except KeyboardInterrupt:
        with contextlib.suppress(OSError):  # the terminal may be gone (SIGHUP)
            print("reach dev: stopping everything it started", flush=True)
        return 0
    finally:
        _stop(processes)
        if key_id is not None and not ready:
            key_store.revoke_key(engine, key_id)
        if services is not None:
            services.stop()
        if lock is not None:
            lock.close()  # the next run may start


def _start(command: list[str], env: dict[str, str], log: Path) -> subprocess.Popen[bytes]:
    # Their own process group: Ctrl-C reaches only this process, which then stops them in
    # order (the worker finishes what it holds).
    with log.open("wb") as out:
        return subprocess.Popen(
            command, env=env, stdout=out, stderr=subprocess.STDOUT, process_group=0
        )


def _interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt  # SIGTERM and SIGHUP stop the stack the same way Ctrl-C does


def _stop(processes: dict[str, subprocess.Popen[bytes]]) -> None:
    for proc in processes.values():
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
    for proc in processes.values():
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            proc.kill()
