"""Baselines A and B: bare Celery with a Redis result backend, and with its database backend.

The same three figures for each: how fast one process publishes (``apply_async`` alone, no
worker), throughput of N tasks through a real prefork worker (publish all, then wait until
every result is stored), and the ``apply_async(...).get()`` round trip, one call at a time.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

import psycopg
import redis
from celery import Celery

from bench import bareapp, machine
from bench.machine import Meter
from bench.processes import Children, celery_worker, child_env
from bench.stats import latency_ms, rate

IDLE_QUEUE = "bench.idle"  # no worker consumes it: the publish-rate figure needs none
WAIT_LIMIT_S = 600
POLL_S = 0.01


class ResultStore(Protocol):
    """How the bench sees, without asking Celery, which of some task ids have a result."""

    def done(self, ids: list[str]) -> set[str]: ...

    def close(self) -> None: ...


@dataclass(frozen=True)
class Baseline:
    """One bare-Celery configuration: where its broker and results live."""

    key: str  # "a" or "b"
    title: str
    broker_url: str
    result_backend: str
    results: Callable[[], ResultStore]


class RedisResults:
    def __init__(self, redis_url: str) -> None:
        self.client = redis.Redis.from_url(redis_url)

    def done(self, ids: list[str]) -> set[str]:
        found: set[str] = set()
        for start in range(0, len(ids), 500):
            chunk = ids[start : start + 500]
            values = self.client.mget([f"celery-task-meta-{i}" for i in chunk])
            found.update(i for i, v in zip(chunk, values, strict=True) if _succeeded(v))
        return found

    def close(self) -> None:
        self.client.close()


def _succeeded(value: bytes | str | None) -> bool:
    return value is not None and json.loads(value).get("status") == "SUCCESS"


class DatabaseResults:
    def __init__(self, libpq_url: str) -> None:
        self.conn = psycopg.connect(libpq_url, autocommit=True)

    def done(self, ids: list[str]) -> set[str]:
        rows = self.conn.execute(
            "SELECT task_id FROM celery_taskmeta WHERE status = 'SUCCESS' AND task_id = ANY(%s)",
            (ids,),
        ).fetchall()
        return {r[0] for r in rows}

    def close(self) -> None:
        self.conn.close()


def measure(
    baseline: Baseline,
    children: Children,
    *,
    tasks: int,
    round_trips: int,
    publishes: int,
    concurrency: int,
    progress: Callable[[str], None],
    meter: Meter,
) -> dict[str, Any]:
    app = bareapp.create_app(baseline.broker_url, baseline.result_backend)
    key = f"baseline_{baseline.key}"
    try:
        progress(f"{baseline.title}: publish rate ({publishes} apply_async calls)")
        with meter.phase(f"{key}.publish"):
            published = publish_rate(app, publishes)
        env = child_env(
            BENCH_BROKER_URL=baseline.broker_url, BENCH_RESULT_BACKEND=baseline.result_backend
        )
        worker = celery_worker(
            children, f"bench-{baseline.key}", "bench.bareapp", bareapp.QUEUE, concurrency, env
        )
        warm_up(app, worker_alive=worker.alive, rounds=4 * concurrency)
        progress(f"{baseline.title}: throughput ({tasks} tasks, concurrency {concurrency})")
        with meter.phase(f"{key}.throughput"):
            worker_cpu_s, client_cpu_s = worker.cpu_s(), time.process_time()
            services_at_start = machine.services_cpu()
            through = throughput(app, tasks, baseline.results)
            through["worker_cpu_ms_per_task"] = _per_task_ms(worker.cpu_s() - worker_cpu_s, tasks)
            through["client_cpu_ms_per_task"] = _per_task_ms(
                time.process_time() - client_cpu_s, tasks
            )
            through["services_cpu_ms_per_task"] = _per_task_ms(
                machine.services_cpu_since(services_at_start), tasks
            )
            parts = ("worker", "client", "services")
            through["all_cpu_ms_per_task"] = round(
                sum(through[f"{part}_cpu_ms_per_task"] for part in parts), 3
            )
        progress(f"{baseline.title}: round trip ({round_trips} sequential calls)")
        with meter.phase(f"{key}.round_trip"):
            trips = round_trip(app, round_trips)
        children.stop(worker)
    finally:
        app.close()
    return {"publish": published, "throughput": through, "round_trip": trips}


def _per_task_ms(cpu_s: float, tasks: int) -> float:
    return round(cpu_s * 1000 / max(1, tasks), 3)


def _noop(app: Celery) -> Any:
    return app.tasks[bareapp.TASK]


def publish_rate(app: Celery, count: int) -> dict[str, Any]:
    noop = _noop(app)
    for i in range(20):  # connect and fill the producer pool before timing
        noop.apply_async(({"i": i},), queue=IDLE_QUEUE)
    started = time.perf_counter()
    for i in range(count):
        noop.apply_async(({"i": i},), queue=IDLE_QUEUE)
    elapsed = time.perf_counter() - started
    with app.connection_for_write() as conn:
        conn.default_channel.queue_purge(IDLE_QUEUE)
    return {"calls": count, "elapsed_s": round(elapsed, 3), "calls_per_s": rate(count, elapsed)}


def warm_up(app: Celery, *, worker_alive: Callable[[], bool], rounds: int) -> None:
    """Wait until the worker answers (its pool processes forked and connected)."""
    noop = _noop(app)
    deadline = time.monotonic() + 60
    while True:
        if not worker_alive():
            raise RuntimeError("the baseline worker exited; see its log")
        try:
            noop.apply_async(({"warm": True},)).get(timeout=2)
            break
        except Exception:  # celery.exceptions.TimeoutError: not consuming yet
            if time.monotonic() > deadline:
                raise
    results = [noop.apply_async(({"warm": i},)) for i in range(rounds)]
    for result in results:
        result.get(timeout=30)


def throughput(app: Celery, count: int, results: Callable[[], ResultStore]) -> dict[str, Any]:
    noop = _noop(app)
    store = results()  # connected before the clock starts
    try:
        started = time.perf_counter()
        pending = [noop.apply_async(({"i": i},)).id for i in range(count)]
        published = time.perf_counter() - started
        done = wait_stored(pending, store)
    finally:
        store.close()
    elapsed = time.perf_counter() - started
    return {
        "tasks": count,
        # A task without a result raises in ``wait_stored``: every one was published and
        # succeeded, which Agent-Reach's figures have to show (``report.incomplete``).
        "accepted": count,
        "succeeded": done,
        "errors": 0,
        "publish_s": round(published, 3),
        "elapsed_s": round(elapsed, 3),
        "tasks_per_s": rate(done, elapsed),
    }


def wait_stored(ids: list[str], store: ResultStore) -> int:
    pending = set(ids)
    deadline = time.monotonic() + WAIT_LIMIT_S
    while pending and time.monotonic() < deadline:
        pending -= store.done(list(pending))
        if pending:
            time.sleep(POLL_S)
    if pending:
        raise RuntimeError(f"{len(pending)} of {len(ids)} tasks had no result after the limit")
    return len(ids)


def round_trip(app: Celery, count: int) -> dict[str, Any]:
    """``apply_async(...).get()`` one after another, as Celery's defaults have it (the
    database backend polls for the result every 0.5 s; the Redis one is told by pub/sub)."""
    noop = _noop(app)
    samples: list[float] = []
    for i in range(count):
        sent = time.perf_counter()
        result = noop.apply_async(({"i": i},)).get(timeout=30)
        samples.append(time.perf_counter() - sent)
        if result != {"i": i}:
            raise RuntimeError(f"the noop task returned {result!r}")
    return latency_ms(samples)
