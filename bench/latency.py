"""Where a sync round trip's time goes: ``python -m bench.latency``.

Starts the stack of the model-latency phase (the API, one threads worker ``-c 500`` serving
``echo`` and ``llm.complete``, the loopback model) on a fresh database, optionally fills it
with a burst of tasks first (``--burst``, as the phase's N tasks do before its round trips),
then makes ``--n`` sync calls one at a time for each capability. Each call is taken apart with
the clock of this machine and the task row's timestamps:

- **accept**: the request sent to the row's ``created_at`` (the API before its insert);
- **to claim**: ``created_at`` to ``started_at`` (insert, message, the worker's intake and
  its claim statement);
- **run**: ``started_at`` to ``finished_at`` minus the model's delay (the running event, the
  handler, its model call, the finish statement);
- **answer**: ``finished_at`` to the response read (the final event, the API's wait, the
  response).

The parts are p50s of each, so they need not add up to the p50 of the whole.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import time
from pathlib import Path
from tempfile import mkdtemp
from typing import Any

import psycopg

from bench import loadgen
from bench.environment import fresh_stores
from bench.model import MODEL_DELAY_S, PROMPT, _healthy
from bench.processes import BIN, Children, child_env, free_port, wait_until
from bench.reach import wait_final
from bench.stack import Stack, running_stack
from bench.stats import percentile

PARTS = ("accept", "to_claim", "run", "answer", "whole")
ROWS = """
SELECT extract(epoch FROM created_at), extract(epoch FROM started_at),
       extract(epoch FROM finished_at)
FROM tasks WHERE id = %s
"""


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m bench.latency", description=__doc__)
    parser.add_argument("--n", type=int, default=40, help="sync calls per capability (40)")
    parser.add_argument("--burst", type=int, default=2000, help="tasks run first (2000; 0: none)")
    parser.add_argument("--delay", type=float, default=MODEL_DELAY_S, help="the model's delay")
    return parser.parse_args(argv)


def breakdown(
    stack: Stack, capability: str, payload: Any, delay_s: float, n: int
) -> dict[str, dict[int, float]]:
    envelope = {"capability": capability, "payload": payload, "reply_mode": "sync"}
    calls = []
    with loadgen.Caller(stack.port, stack.key("lat")) as caller:
        for _ in range(3):  # connections and clients made before the clock
            caller.post("/tasks", envelope)
        for _ in range(n):
            sent = time.time()
            answer = caller.post("/tasks", envelope)
            calls.append((answer.json()["task_id"], sent, time.time()))
    parts: dict[str, list[float]] = {part: [] for part in PARTS}
    with psycopg.connect(stack.stores.libpq_url) as conn:
        for task_id, sent, read in calls:
            created, started, finished = (
                float(t) for t in conn.execute(ROWS, (task_id,)).fetchone() or ()
            )
            parts["accept"].append(created - sent)
            parts["to_claim"].append(started - created)
            parts["run"].append(finished - started - delay_s)
            parts["answer"].append(read - finished)
            parts["whole"].append(read - sent - delay_s)
    return {
        part: {q: round(percentile(samples, q) * 1000, 2) for q in (50, 95)}
        for part, samples in parts.items()
    }


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    with fresh_stores() as stores, Children(Path(mkdtemp(prefix="bench-latency-"))) as children:
        port = free_port()
        model_args = [str(BIN / "python"), "-m", "reach.fakemodel", f"--port={port}"]
        children.start("fakemodel", [*model_args, f"--delay={args.delay}"], child_env())
        base = f"http://127.0.0.1:{port}"
        wait_until(lambda: _healthy(base), timeout_s=30, what="waiting for the model")
        queues = "echo,llm.complete"
        with running_stack(
            stores, children, 500, queues=queues, pool="threads", REACH_MODEL_URL=base
        ) as stack:
            if args.burst:
                token = stack.key("burst")
                envelope = {"capability": "llm.complete", "payload": {"prompt": PROMPT}}
                sent = asyncio.run(
                    loadgen.accept_rate(
                        stack.port, token, envelope, connections=64, requests=args.burst
                    )
                )
                wait_final(stores.libpq_url, "burst", sent["accepted"])
            rows = [
                ("echo", breakdown(stack, "echo", {"i": 1}, 0.0, args.n)),
                (
                    "llm.complete",
                    breakdown(stack, "llm.complete", {"prompt": PROMPT}, args.delay, args.n),
                ),
            ]
    print(f"sync round trips, {args.n} each, after a burst of {args.burst}; ms, p50 / p95")
    print(f"| capability   | {' | '.join(f'{p:>13}' for p in PARTS)} |")
    print(f"|--------------|{'|'.join('-' * 15 for _ in PARTS)}|")
    for name, parts in rows:
        cells = " | ".join(f"{parts[p][50]:>5} / {parts[p][95]:>5}" for p in PARTS)
        print(f"| {name:<12} | {cells} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
