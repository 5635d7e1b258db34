"""Does expiry keep pace with intake at millions of rows? ``python -m bench.retention``.

Fills a fresh database's ``tasks`` with ``--rows`` finished rows (``--expired`` of them past
their TTL), then measures, with the janitor's own code:

- the janitor: ``purge_expired`` batches of 1,000, rows removed per second, and what one run
  (at most 100 batches, every minute by default) removes per second of wall time;
- a submit's insert: the single-row INSERT of ``broker.tasks.submission``, one at a time;
- a list: ``GET /tasks``'s query (``broker.tasks.queries.list_tasks``), a page of 50.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
import uuid
from typing import Any

import psycopg
from sqlalchemy import insert

from bench.environment import fresh_stores
from bench.stats import latency_ms, rate
from broker import jsonbody
from broker.db.engines import async_engine, sync_engine
from broker.db.models import tasks_table
from broker.settings import Settings
from broker.tasks import queries
from broker.tasks.execution import purge_expired

TENANT = "retention"
FILL = """
INSERT INTO tasks (id, tenant, capability, queue, status, payload, payload_digest,
                   payload_size, result, attempts, trace_id, metadata, result_ttl_s,
                   created_at, started_at, finished_at, expires_at)
SELECT gen_random_uuid(), %(tenant)s, 'echo', 'echo', 'succeeded', '{"i": 1}', 'digest', 8,
       '{"i": 1}', 1, md5(g::text), '{}', 86400,
       now() - interval '2 days', now() - interval '2 days', now() - interval '2 days',
       CASE WHEN g <= %(expired)s THEN now() - interval '1 hour' ELSE now() + interval '1 day' END
FROM generate_series(1, %(rows)s) AS g
"""


def fill(libpq_url: str, rows: int, expired: int) -> float:
    started = time.perf_counter()
    with psycopg.connect(libpq_url, autocommit=True) as conn:
        for offset in range(0, rows, 500_000):  # several statements: each one's WAL is bounded
            chunk = min(500_000, rows - offset)
            expired_here = max(0, min(chunk, expired - offset))
            conn.execute(FILL, {"tenant": TENANT, "rows": chunk, "expired": expired_here})
        conn.execute("VACUUM ANALYZE tasks")
    return time.perf_counter() - started


def janitor(settings: Settings, batches: int) -> dict[str, Any]:
    engine = sync_engine(settings)
    samples = []
    removed = 0
    try:
        for _ in range(batches):
            started = time.perf_counter()
            count = purge_expired(engine, batch=settings.janitor_batch, budget_s=0)
            samples.append(time.perf_counter() - started)
            removed += count
    finally:
        engine.dispose()
    spent = sum(samples)
    return {
        "batch": settings.janitor_batch,
        "batches": len(samples),
        "removed": removed,
        "batch_ms": latency_ms(samples, (50, 99)),
        "rows_per_s_while_running": rate(removed, spent),
        # A run every janitor_interval_s, each deleting for at most janitor_budget_s.
        "rows_per_s_at_the_schedule": round(
            rate(removed, spent) * settings.janitor_budget_s / settings.janitor_interval_s, 1
        ),
    }


def inserts(settings: Settings, count: int) -> dict[str, Any]:
    engine = sync_engine(settings)
    digest, size = jsonbody.digest({"i": 1})
    samples = []
    try:
        for _ in range(count):
            values = {
                "id": uuid.uuid4(),
                "tenant": TENANT,
                "capability": "echo",
                "queue": "echo",
                "status": "queued",
                "payload": {"i": 1},
                "payload_digest": digest,
                "payload_size": size,
                "trace_id": uuid.uuid4().hex,
                "result_ttl_s": 86400,
                "expires_at": "2999-01-01T00:00:00Z",
            }
            started = time.perf_counter()
            with engine.begin() as conn:
                conn.execute(insert(tasks_table).values(values))
            samples.append(time.perf_counter() - started)
    finally:
        engine.dispose()
    return latency_ms(samples, (50, 99))


def lists(settings: Settings, count: int) -> dict[str, Any]:
    async def run() -> list[float]:
        engine = async_engine(settings, pool_size=1)
        samples = []
        try:
            for _ in range(count):
                started = time.perf_counter()
                await queries.list_tasks(
                    engine,
                    TENANT,
                    capability=None,
                    status=None,
                    limit=50,
                    cursor=None,
                    patterns=("*",),
                    max_bytes=settings.list_page_max_bytes,
                )
                samples.append(time.perf_counter() - started)
        finally:
            await engine.dispose()
        return samples

    return latency_ms(asyncio.run(run()), (50, 99))


def measure(rows: int, expired: int, batches: int, samples: int) -> dict[str, Any]:
    with fresh_stores() as stores:
        settings = Settings(database_url=stores.database_url, redis_url=stores.redis_url)
        fill_s = fill(stores.libpq_url, rows, expired)
        return {
            "rows": rows,
            "expired": expired,
            "fill_s": round(fill_s, 1),
            "insert": inserts(settings, samples),
            "list": lists(settings, samples),
            "janitor": janitor(settings, batches),
        }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.retention", description=__doc__)
    parser.add_argument("--rows", type=int, default=2_000_000)
    parser.add_argument("--expired", type=int, help="rows past their TTL (half by default)")
    parser.add_argument("--batches", type=int, default=100, help="janitor batches timed")
    parser.add_argument("--samples", type=int, default=200, help="inserts and lists timed")
    args = parser.parse_args(argv)
    expired = args.rows // 2 if args.expired is None else args.expired
    print(json.dumps(measure(args.rows, expired, args.batches, args.samples), indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
