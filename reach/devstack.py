"""``reach dev``: the whole stack on one machine, for trying it out.

Uses ``REACH_DATABASE_URL``/``DATABASE_URL`` and ``REACH_REDIS_URL``/``REDIS_URL`` when set,
the services on the standard local ports when they answer, and otherwise starts an embedded
Postgres and Redis under ``.reach/``. Ctrl-C stops everything it started.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from urllib.parse import urlsplit

import httpx

from broker.db.engines import sync_engine
from broker.settings import Settings
from broker.tasks.dispatch import MAINTENANCE_QUEUE, WEBHOOKS_QUEUE
from broker.tenancy import key_store
from reach import localservices, migrate

DATA_DIR = Path(".reach")
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
    services = localservices.ensure_services(
        data_dir,
        database_url=env.get("REACH_DATABASE_URL") or env.get("DATABASE_URL"),
        redis_url=env.get("REACH_REDIS_URL") or env.get("REDIS_URL"),
    )
    database_url = services.database_url
    if not (env.get("REACH_DATABASE_URL") or env.get("DATABASE_URL")):
        database_url = localservices.create_database(database_url, "reach", exist_ok=True)
    env.update(REACH_DATABASE_URL=database_url, REACH_REDIS_URL=services.redis_url)
    # Webhooks to a receiver on this machine: the deny table refuses loopback otherwise.
    env.setdefault("REACH_WEBHOOK_ALLOW", DEV_WEBHOOK_ALLOW)
    # The API listens on loopback here: /metrics needs no token (elsewhere it does).
    env.setdefault("REACH_METRICS_PUBLIC", "true")
    # llm.complete calls the stand-in model the stack runs, unless a real one is named.
    env.setdefault("REACH_MODEL_URL", f"http://127.0.0.1:{_free_port()}")
    return env, services


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


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


def _wait_ready(
    api: str, token: str, processes: dict[str, subprocess.Popen[bytes]], timeout_s: float
) -> None:
    """Until the API is ready and every example capability has a live agent, so the printed
    curl works the moment it is shown."""
    deadline = time.monotonic() + timeout_s
    wanted = {*CAPABILITY_QUEUES.split(","), *ASYNC_QUEUES.split(",")}
    while time.monotonic() < deadline:
        for name, proc in processes.items():
            if proc.poll() is not None:
                raise RuntimeError(f"{name} exited with {proc.returncode}; see its output above")
        if wanted <= _live_capabilities(api, token):
            return
        time.sleep(0.3)
    raise RuntimeError(f"{api} not ready with live agents after {timeout_s:.0f} s")


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


def _banner(
    port: int, flower_port: int, token: str, services: localservices.Services, allow: str
) -> str:
    api = f"http://127.0.0.1:{port}"
    where = f"embedded {', '.join(services.embedded)}" if services.embedded else "local services"
    return f"""
Agent-Reach is running ({where}).
  API      {api}        docs {api}/docs
  Flower   http://127.0.0.1:{flower_port}
  API key  {token}
           tenant "dev", operator and tenant admin: it sets the callback secret too
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
    # Ctrl-C and SIGTERM stop the stack from the first moment, even when started from a shell
    # that made background jobs ignore SIGINT.
    signal.signal(signal.SIGINT, signal.default_int_handler)
    signal.signal(signal.SIGTERM, _interrupt)
    data_dir = DATA_DIR.resolve()
    data_dir.mkdir(exist_ok=True)
    processes: dict[str, subprocess.Popen[bytes]] = {}
    services: localservices.Services | None = None
    try:
        env, services = _environment(data_dir)
        migrate.upgrade(env["REACH_DATABASE_URL"])
        settings = Settings(
            database_url=env["REACH_DATABASE_URL"], redis_url=env["REACH_REDIS_URL"]
        )
        _, token = key_store.create_key(
            sync_engine(settings), "dev", ["*"], is_admin=True, tenant_admin=True, name="dev"
        )
        commands = _commands(port, flower_port, data_dir, env["REACH_MODEL_URL"])
        for name, command in commands.items():
            # Their own process group: Ctrl-C reaches only this process, which then stops
            # them in order (the worker finishes what it holds).
            processes[name] = subprocess.Popen(command, env=env, process_group=0)
        _wait_ready(f"http://127.0.0.1:{port}", token, processes, timeout_s=90)
        allow = env["REACH_WEBHOOK_ALLOW"]
        print(_banner(port, flower_port, token, services, allow), flush=True)
        while all(p.poll() is None for p in processes.values()):
            time.sleep(0.5)
        return 1
    except KeyboardInterrupt:
        return 0
    finally:
        _stop(processes)
        if services is not None:
            services.stop()


def _interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt  # SIGTERM stops the stack the same way Ctrl-C does


def _stop(processes: dict[str, subprocess.Popen[bytes]]) -> None:
    for proc in processes.values():
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
    for proc in processes.values():
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            proc.kill()
