"""Does one tenant's flood hold up another tenant's tasks? ``python -m bench.fairness``.

A hog submits ``--flood`` ``text.summarize`` tasks over 64 connections; then a calm tenant
submits ``--calm`` more, one after another, to the same queue. One prefork worker
(``--concurrency`` processes) serves it. Measured, with ``REACH_QUEUE_FAIR_SLICE`` at
``--slice`` and then at 0 (first come, first served), each on fresh stores:

- how many of the hog's tasks were still waiting when the calm tenant submitted;
- how long each calm task waited for a worker (``started_at - created_at``).

Prints JSON. The per-tenant share of a queue is off (``bench.stack``), so that the hog's
whole flood gets in.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
from pathlib import Path
from tempfile import mkdtemp
from typing import Any

import httpx
import psycopg

from bench import loadgen
from bench.environment import fresh_stores
from bench.processes import Children
from bench.reach import wait_final
from bench.stack import running_stack
from bench.stats import latency_ms

CAPABILITY = "text.summarize"
TEXT = "One sentence here. Another one there. A third, so that there is something to keep."


def measure(flood: int, calm: int, fair_slice: int, concurrency: int) -> dict[str, Any]:
    envelope = {"capability": CAPABILITY, "payload": {"text": TEXT}}
    with (
        fresh_stores() as stores,
        Children(Path(mkdtemp(prefix="bench-fairness-"))) as children,
        running_stack(
            stores, children, concurrency, REACH_QUEUE_FAIR_SLICE=str(fair_slice)
        ) as stack,
    ):
        flooded = asyncio.run(
            loadgen.accept_rate(
                stack.port, stack.key("hog"), envelope, connections=64, requests=flood
            )
        )
        with psycopg.connect(stores.libpq_url, autocommit=True) as conn:
            row = conn.execute(
                "SELECT count(*) FROM tasks WHERE tenant = 'hog' AND status = 'queued'"
            ).fetchone()
        hog_waiting = int(row[0]) if row else 0
        with httpx.Client(
            base_url=stack.url,
            headers={"Authorization": f"Bearer {stack.key('calm')}"},
            timeout=30,
        ) as http:
            for _ in range(calm):
                http.post("/tasks", json=envelope).raise_for_status()
        statuses = wait_final(stores.libpq_url, "calm", calm)
        with psycopg.connect(stores.libpq_url, autocommit=True) as conn:
            waits = [
                float(seconds)
                for (seconds,) in conn.execute(
                    "SELECT extract(epoch FROM started_at - created_at) FROM tasks"
                    " WHERE tenant = 'calm'"
                )
            ]
    return {
        "fair_slice": fair_slice,
        "hog_accepted": flooded["accepted"],
        "hog_waiting_at_calm_submits": hog_waiting,
        "calm_statuses": statuses,
        "calm_wait": {**latency_ms(waits, (50,)), "max_ms": round(max(waits) * 1000, 3)},
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.fairness", description=__doc__)
    parser.add_argument("--flood", type=int, default=3000, help="the hog's tasks")
    parser.add_argument("--calm", type=int, default=20, help="the calm tenant's tasks")
    parser.add_argument("--slice", type=int, default=100, help="REACH_QUEUE_FAIR_SLICE")
    parser.add_argument("--concurrency", type=int, default=2, help="worker processes")
    args = parser.parse_args(argv)
    runs = [
        measure(args.flood, args.calm, fair_slice, args.concurrency)
        for fair_slice in (args.slice, 0)
    ]
    json.dump({"flood": args.flood, "calm": args.calm, "runs": runs}, sys.stdout, indent=2)
    print()
    return 0


if __name__ == "__main__":
    sys.exit(main())
