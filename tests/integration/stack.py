"""Processes the integration tests run for real: Celery workers and beat as subprocesses,
the API served by uvicorn on a loopback port."""

from __future__ import annotations

import asyncio
import contextlib
import io
import json
import os
import random
import signal
import socket
import subprocess
import sys
import threading
import uuid
from pathlib import Path
from typing import IO

import httpx
import psutil
import uvicorn
from fastapi import FastAPI
from pydantic import SecretStr

from api.connections import Protocol
from broker.settings import Settings
from broker.tasks.dispatch import MAINTENANCE_QUEUE, WEBHOOKS_QUEUE
from tests.eventually import eventually

BIN = Path(sys.executable).parent
ROOT = Path(__file__).resolve().parents[2]


def _ephemeral_ports() -> range:
    """The ports the kernel hands to outgoing connections and to ``bind(0)``."""
    try:
        low, high = map(int, Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split())
    except (OSError, ValueError):
        low, high = 32768, 60999  # Linux's default
    return range(low, high + 1)


_handed_out: set[int] = set()
_ports = random.Random(os.getpid())


def free_port(count: int = 1) -> int:
    """A loopback port nothing listens on, for a server a test starts later (the first of
    ``count`` in a row). Not one the kernel would pick (``bind(0)``): between the pick and the
    server's bind, any outgoing connection of the machine (a worker's to Redis, a client's to
    the API) could take such a port as its own end, and the server then failed to start.
    Below the ephemeral range only a listener can hold one, and none is handed out twice in
    one test session."""
    ephemeral = _ephemeral_ports()
    low, high = (20000, ephemeral.start - count) if ephemeral.start > 21000 else (1024, 65535)
    while True:
        first = _ports.randint(low, high)
        wanted = range(first, first + count)
        if any(p in _handed_out or p in ephemeral or p > 65535 for p in wanted):
            continue
        try:
            with contextlib.ExitStack() as stack:
                for port in wanted:
                    stack.enter_context(socket.socket()).bind(("127.0.0.1", port))
        except OSError:
            continue
        _handed_out.update(wanted)
        return first


def environment(settings: Settings) -> dict[str, str]:
    """The process environment that gives a subprocess exactly these settings."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("REACH_")}
    for name, value in settings.model_dump().items():
        if value is None:
            continue
        if isinstance(value, SecretStr):
            value = value.get_secret_value()
        text = ",".join(map(str, value)) if isinstance(value, list) else str(value)
        env[f"REACH_{name.upper()}"] = text
    env["PYTHONPATH"] = str(ROOT)
    return env


class CeleryProcess:
    """``celery -A <app> <args>`` with its output in a log file; started and waited for."""

    def __init__(
        self,
        args: list[str],
        settings: Settings,
        log_path: Path,
        env: dict[str, str] | None = None,
        *,
        app: str = "workers",
    ) -> None:
        self.args = args
        self.app = app
        self.settings = settings
        self.log_path = log_path
        self.env = env or {}
        self.process: subprocess.Popen[bytes] | None = None
        self._log: IO[bytes] | None = None

    def start(self, ready_marker: str, timeout_s: float = 60) -> CeleryProcess:
        self._log = self.log_path.open("wb")
        self.process = subprocess.Popen(
            [str(BIN / "celery"), "-A", self.app, *self.args],
            env={**environment(self.settings), **self.env},
            cwd=ROOT,
            stdout=self._log,
            stderr=subprocess.STDOUT,
        )
        process = self.process
        with contextlib.suppress(AssertionError):  # a hang is reported below, with the log
            eventually(
                lambda: ready_marker in self.output() or process.poll() is not None,
                f"celery {self.args[0]} to start or exit",
                timeout_s,
                0.1,
            )
        if ready_marker not in self.output():
            self.stop()
            raise RuntimeError(f"celery {self.args[0]} did not start:\n{self.output()}")
        return self

    def output(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""

    @property
    def pid(self) -> int:
        assert self.process is not None
        return self.process.pid

    def kill_hard(self) -> None:
        """kill -9 the worker and its pool processes, as a machine crash would."""
        assert self.process is not None
        family = [self.process.pid, *(c.pid for c in psutil.Process(self.pid).children(True))]
        for pid in family:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        self.process.wait()

    def stop(self, sig: int = signal.SIGTERM, timeout_s: float = 30) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.send_signal(sig)
            try:
                self.process.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        if self._log is not None:
            self._log.close()


def start_worker(
    settings: Settings,
    queues: str,
    name: str,
    log_dir: Path,
    env: dict[str, str] | None = None,
    concurrency: int = 2,
    pool: str | None = None,
) -> CeleryProcess:
    args = ["worker", "-Q", queues, "-n", f"{name}@%h", "-c", str(concurrency), "-l", "INFO"]
    args += ["-P", pool] if pool else []
    args += ["--without-gossip", "--without-mingle"]
    return CeleryProcess(args, settings, log_dir / f"{name}.log", env).start(" ready.")


def start_system_workers(
    settings: Settings, log_dir: Path, prefix: str = "", webhooks_concurrency: int = 2
) -> list[CeleryProcess]:
    """The maintenance worker and the webhooks worker, each on its own queue as deployed:
    receivers holding every delivery slot never hold up the reaper, sweepers or janitor."""
    return [
        start_worker(settings, MAINTENANCE_QUEUE, f"{prefix}maintenance", log_dir),
        start_worker(
            settings, WEBHOOKS_QUEUE, f"{prefix}webhooks", log_dir, concurrency=webhooks_concurrency
        ),
    ]


def start_beat(settings: Settings, log_dir: Path, name: str = "beat") -> CeleryProcess:
    args = ["beat", "-l", "INFO", "--schedule", str(log_dir / f"{name}-schedule")]
    return CeleryProcess(args, settings, log_dir / f"{name}.log").start("beat: Starting")


GRACEFUL_SHUTDOWN_S = 3


class ServedApp:
    """The ASGI app on a real port, in a thread of this process."""

    def __init__(self, app: FastAPI, port: int | None = None) -> None:
        self.port = free_port() if port is None else port
        self.url = f"http://127.0.0.1:{self.port}"
        # Streams a test left open end after a few seconds, so the app's lifespan ends too:
        # uvicorn would otherwise wait for them, and the app's background tasks outlive it.
        config = uvicorn.Config(
            app,
            http=Protocol,
            host="127.0.0.1",
            port=self.port,
            log_level="warning",
            timeout_graceful_shutdown=GRACEFUL_SHUTDOWN_S,
        )
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, daemon=True)

    def __enter__(self) -> ServedApp:
        self.thread.start()
        eventually(
            lambda: self.server.started or not self.thread.is_alive(), "the API to start or stop"
        )
        if not self.server.started:
            raise RuntimeError("the API did not start")
        self.loop = self.server.servers[0].get_loop()
        return self

    def __exit__(self, *exc: object) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=10)
        if self.thread.is_alive() and exc[0] is None:
            raise RuntimeError(
                "the API did not stop: its lifespan's tasks would outlive the test. Its tasks:\n"
                + self.tasks()
            )

    def tasks(self) -> str:
        """Where each task on the app's loop waits (read from this thread: a diagnosis)."""
        out = io.StringIO()
        for task in list(asyncio.all_tasks(self.loop)):
            out.write(f"{task.get_name()}:\n")
            task.print_stack(file=out)
        return out.getvalue()


def wait_for_task(
    client: httpx.Client, task_id: str, statuses: set[str], timeout_s: float = 30
) -> dict[str, object]:
    """Poll until the task reaches one of ``statuses``; the timeout only bounds a hang."""

    def read() -> dict[str, object]:
        task: dict[str, object] = client.get(f"/tasks/{task_id}").json()
        return task

    return eventually(
        read,
        f"task {task_id} {' or '.join(sorted(statuses))}",
        timeout_s,
        until=lambda task: task.get("status") in statuses,
    )


async def submit_many(
    api: ServedApp, token: str, envelopes: list[dict[str, object]], concurrency: int = 32
) -> list[httpx.Response]:
    """POST every envelope, ``concurrency`` at a time, as a careful client does: each with an
    idempotency key of its own, sent again on a broken connection (a keep-alive connection the
    server closed as the request went out, on a loaded machine), where the key makes sure a
    request that did arrive is not accepted twice."""
    gate = asyncio.Semaphore(concurrency)
    async with httpx.AsyncClient(
        base_url=api.url, timeout=60, headers={"Authorization": f"Bearer {token}"}
    ) as http:

        async def one(envelope: dict[str, object]) -> httpx.Response:
            headers = {"Idempotency-Key": f"submit-many-{uuid.uuid4()}"}
            async with gate:
                for attempt in range(3):
                    try:
                        return await http.post("/tasks", json=envelope, headers=headers)
                    except httpx.TransportError:
                        if attempt == 2:
                            raise
            raise AssertionError("unreachable")

        return await asyncio.gather(*(one(e) for e in envelopes))


def consumed_queues(settings: Settings) -> dict[str, set[str]]:
    """Each live worker's queues, as ``celery inspect active_queues`` answers."""
    answers = json.loads(
        celery_command(settings, "inspect", "active_queues", "--json").splitlines()[-1]
    )
    return {name: {q["name"] for q in queues} for name, queues in answers.items()}


def celery_command(settings: Settings, *args: str) -> str:
    """``celery -A workers <args>`` (inspect, control) against the test's broker."""
    command = [
        str(Path(sys.executable).parent / "celery"),
        "-A",
        "workers",
        *args,
        "--timeout",
        "5",
    ]
    done = subprocess.run(
        command, env=environment(settings), capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0, done.stderr
    return done.stdout.strip()
