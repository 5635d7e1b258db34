"""What replaying a long event log costs the API: ``python -m bench.replay``.

A task whose log holds ``--events`` events (10,000, the cap: small ``output`` events, then
its final one) is streamed from the start (``GET /tasks/{id}/events``) ``--replays`` times, one
after another, by a client that reads raw bytes off its socket. Figures: the API process's CPU
per replay (psutil), the wall time, and the bytes sent; against them, the CPU of a plain
``GET /tasks/{id}`` of the same task, as many times. Each stream is one of its tenant's slots
and one request of its rate, so this is what a tenant's replay loop takes of the process every
tenant shares.
"""

from __future__ import annotations

import argparse
import json
import socket
import sys
import time
import uuid
from datetime import UTC, datetime, timedelta
from pathlib import Path
from tempfile import mkdtemp
from typing import Any

import psutil
import redis
from sqlalchemy import insert

from bench.environment import fresh_stores
from bench.processes import Children
from bench.stack import running_stack
from broker import jsonbody
from broker.db.engines import sync_engine
from broker.db.models import tasks_table
from broker.settings import Settings
from broker.tasks.events import OUTPUT, EventLog

TENANT = "bench-replay"


def a_running_task(settings: Settings, tenant: str) -> uuid.UUID:
    task_id = uuid.uuid4()
    digest, size = jsonbody.digest({})
    now = datetime.now(UTC)
    engine = sync_engine(settings, pool_size=1)
    try:
        with engine.begin() as conn:
            conn.execute(
                insert(tasks_table).values(
                    id=task_id,
                    tenant=tenant,
                    capability="echo",
                    queue="echo",
                    status="running",
                    payload={},
                    payload_digest=digest,
                    payload_size=size,
                    trace_id=uuid.uuid4().hex,
                    result_ttl_s=3600,
                    created_at=now,
                    expires_at=now + timedelta(hours=1),
                )
            )
    finally:
        engine.dispose()
    return task_id


def fill_log(redis_url: str, task_id: uuid.UUID, events: int) -> None:
    client = redis.Redis.from_url(redis_url)
    log = EventLog(client, 3600, max_bytes=64 << 20, max_events=events)
    try:
        for n in range(events - 1):
            data = {"i": n, "text": "a few words of output"}
            log.append(task_id, OUTPUT, data, tenant=TENANT, trace_id="t" * 32)
        log.append(task_id, "succeeded", {"status": "succeeded"}, tenant=TENANT, trace_id="t" * 32)
    finally:
        client.close()


def read_whole(port: int, path: str, token: str) -> int:
    """The bytes of one answer, read off the socket until its chunked end (or its length)."""
    request = f"GET {path} HTTP/1.1\r\nHost: bench\r\nAuthorization: Bearer {token}\r\n\r\n"
    with socket.create_connection(("127.0.0.1", port), timeout=60) as sock:
        sock.sendall(request.encode())
        received = bytearray()
        while True:
            chunk = sock.recv(1 << 20)
            if not chunk:
                return len(received)
            received += chunk
            head, _, body = bytes(received).partition(b"\r\n\r\n")
            if b"transfer-encoding: chunked" in head.lower():
                if received.endswith(b"\r\n0\r\n\r\n"):
                    return len(received)
            elif b"content-length:" in head.lower():
                length = int(head.lower().split(b"content-length:")[1].split(b"\r\n")[0])
                if len(body) >= length:
                    return len(received)


def timed(api: psutil.Process, times: int, port: int, path: str, token: str) -> dict[str, Any]:
    before = api.cpu_times()
    started = time.perf_counter()
    sizes = [read_whole(port, path, token) for _ in range(times)]
    wall = time.perf_counter() - started
    after = api.cpu_times()
    cpu = (after.user - before.user) + (after.system - before.system)
    return {
        "api_cpu_ms_each": round(cpu * 1000 / times, 2),
        "wall_ms_each": round(wall * 1000 / times, 2),
        "bytes_each": sizes[-1],
    }


def measure(events: int, replays: int) -> dict[str, Any]:
    log_dir = Path(mkdtemp(prefix="bench-replay-"))
    with (
        fresh_stores() as stores,
        Children(log_dir) as children,
        running_stack(stores, children, 1) as stack,
    ):
        settings = Settings(database_url=stores.database_url, redis_url=stores.redis_url)
        token = stack.key(TENANT)
        task_id = a_running_task(settings, TENANT)
        fill_log(stores.redis_url, task_id, events)
        api = psutil.Process(stack.api.pid)
        read_whole(stack.port, f"/tasks/{task_id}/events", token)  # warm
        return {
            "events": events,
            "replay": timed(api, replays, stack.port, f"/tasks/{task_id}/events", token),
            "read": timed(api, replays, stack.port, f"/tasks/{task_id}", token),
        }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.replay", description=__doc__)
    parser.add_argument("--events", type=int, default=10_000, help="events in the log (10000)")
    parser.add_argument("--replays", type=int, default=20, help="replays timed (20)")
    args = parser.parse_args(argv)
    print(json.dumps(measure(args.events, args.replays), indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
