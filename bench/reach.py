"""Agent-Reach measured end to end, through the stack of ``bench.stack``.

Figures: HTTP submit to ``succeeded`` in Postgres for N tasks; the sync round trip; time to
the first SSE frame in stream mode; emit-to-frame latency of agent outputs; the accept rate of
``POST /tasks`` alone (the worker stops consuming, the queue fills); SSE streams held open with
the API's memory.
"""

from __future__ import annotations

import asyncio
import functools
import time
from collections.abc import Callable
from typing import Any

import psutil
import psycopg

from bench import loadgen, machine, streams
from bench.environment import Stores
from bench.machine import Meter
from bench.plan import Plan
from bench.processes import Child, Children, process_cpu_s
from bench.stack import Stack, purge, running_stack, stop_consuming
from bench.stats import latency_ms, rate

FINAL = {"succeeded", "failed", "cancelled", "expired"}
WAIT_LIMIT_S = 600
POLL_S = 0.01
# Eight short sentences; the summarizer streams the five it keeps as output events.
TEXT = " ".join(
    f"Sentence {i} says agents route tasks through queues and workers." for i in range(1, 9)
)


def measure(
    stores: Stores,
    children: Children,
    plan: Plan,
    progress: Callable[[str], None],
    meter: Meter,
) -> dict[str, Any]:
    with running_stack(stores, children, plan.concurrency) as stack:
        figures: dict[str, Any] = {"api_rss_idle_mb": _rss_mb(stack.api), "accept": []}

        def phase(key: str, message: str, run: Callable[[], Any]) -> Any:
            progress(f"Agent-Reach: {message}")
            with meter.phase(f"reach.{key}"):
                return run()

        figures["throughput"] = phase(
            "throughput",
            f"throughput ({plan.tasks} tasks, {plan.submitters} submitters)",
            lambda: throughput(stack, plan.tasks, plan.submitters),
        )
        figures["sync_round_trip"] = phase(
            "sync_round_trip",
            f"sync round trip ({plan.round_trips} sequential)",
            lambda: sync_round_trip(stack, plan.round_trips),
        )
        figures["stream_first_event"] = phase(
            "stream_first_event",
            f"stream time to first event ({plan.stream_trips} sequential)",
            lambda: stream_first_event(stack, plan.stream_trips),
        )
        figures["emit_to_frame"] = phase(
            "emit_to_frame",
            f"emit-to-frame latency ({plan.emit_tasks} streamed tasks)",
            lambda: emit_to_frame(stack, plan.emit_tasks),
        )
        stop_consuming(stack, "echo")  # the queue only fills from here on
        for connections, requests in zip(plan.connections, plan.accept_requests, strict=True):
            run = phase(
                f"accept_{connections}",
                f"accept rate ({requests} POSTs on {connections} connections)",
                functools.partial(accept, stack, connections, requests),
            )
            figures["accept"].append(run)
            purge(stack, "echo")  # each run starts from an empty queue, below the depth bound
        figures["streams"] = phase(
            "streams",
            f"{plan.streams} SSE streams held {plan.hold_s:.0f}s",
            lambda: hold_streams(stack, plan.streams, plan.hold_s),
        )
        return figures


def _rss_mb(child: Child) -> float:
    return round(psutil.Process(child.pid).memory_info().rss / 2**20, 1)


def throughput(
    stack: Stack, count: int, submitters: int, tenant: str = "bench-throughput"
) -> dict[str, Any]:
    """N echo tasks submitted over HTTP on ``submitters`` concurrent connections, then
    Postgres watched until all of them are ``succeeded``. ``tenant`` is new for each run:
    the tasks are counted by tenant."""
    token = stack.key(tenant)
    envelope = {"capability": "echo", "payload": {"i": 0}}
    with machine.cpu_spent(api=stack.api.cpu_s, worker=stack.worker.cpu_s) as spent:
        submitted = asyncio.run(
            loadgen.accept_rate(stack.port, token, envelope, connections=submitters, requests=count)
        )
        counts = wait_final(stack.stores.libpq_url, tenant, submitted["accepted"])
        elapsed = loadgen.sent_from(submitted)
    done = outcome(count, submitted, counts)
    return {
        **done,
        "submit_statuses": submitted["statuses"],
        "final_statuses": counts,
        "submit_s": submitted["elapsed_s"],
        "submit_per_s": submitted["accepted_per_s"],
        "elapsed_s": round(elapsed, 3),
        "tasks_per_s": rate(done["succeeded"], elapsed),
        # CPU per task is what contention cannot inflate much: it shows where the work goes.
        **machine.per_task_ms(spent, done["succeeded"]),
    }


def outcome(tasks: int, submitted: dict[str, Any], counts: dict[str, int]) -> dict[str, int]:
    """What became of ``tasks`` asked for: accepted (202), succeeded, and errors (a POST
    answered with an error, timed out or dropped; a task final but not ``succeeded``). A rate
    is only a figure when all of them were accepted and succeeded with no error
    (``report.incomplete``): the bare baselines raise on a missing result."""
    failed = sum(n for status, n in counts.items() if status in FINAL and status != "succeeded")
    return {
        "tasks": tasks,
        "accepted": submitted["accepted"],
        "succeeded": counts.get("succeeded", 0),
        "errors": submitted["errors"] + failed,
    }


def wait_final(libpq_url: str, tenant: str, expected: int) -> dict[str, int]:
    """Poll Postgres until ``expected`` tasks of ``tenant`` are final; their counts by status."""
    deadline = time.monotonic() + WAIT_LIMIT_S
    with psycopg.connect(libpq_url, autocommit=True) as conn:
        while True:
            rows = conn.execute(
                "SELECT status, count(*) FROM tasks WHERE tenant = %s GROUP BY status", (tenant,)
            ).fetchall()
            counts = {status: int(n) for status, n in rows}
            if sum(n for s, n in counts.items() if s in FINAL) >= expected:
                return counts
            if time.monotonic() > deadline:
                raise RuntimeError(f"tasks still not final after {WAIT_LIMIT_S}s: {counts}")
            time.sleep(POLL_S)


def sync_round_trip(stack: Stack, count: int) -> dict[str, Any]:
    """``reply_mode: sync`` one request after another on one keep-alive connection."""
    samples: list[float] = []
    with loadgen.Caller(stack.port, stack.key("bench-sync")) as caller:
        for i in range(count):
            envelope = {"capability": "echo", "payload": {"i": i}, "reply_mode": "sync"}
            sent = time.perf_counter()
            response = caller.post("/tasks", envelope)
            samples.append(time.perf_counter() - sent)
            task = response.json()
            if response.status != 200 or task.get("result") != {"i": i}:
                raise RuntimeError(f"sync echo answered {response.status}: {task}")
    return latency_ms(samples)


async def _stream(port: int, raw: bytes) -> tuple[float, list[tuple[float, dict[str, Any]]]]:
    """One stream-mode POST on a fresh connection (opened before the clock): seconds to the
    first frame, and every frame to the final one with its arrival time."""
    conn = await loadgen.Connection(port).open()
    first_s = 0.0
    frames: list[tuple[float, dict[str, Any]]] = []
    try:
        sent = time.perf_counter()
        async for arrived_at, frame in conn.stream(raw):
            if not frames:
                first_s = time.perf_counter() - sent
            frames.append((arrived_at, frame))
            if frame.get("event") in FINAL:
                break
    finally:
        await conn.close()
    return first_s, frames


def stream_first_event(stack: Stack, count: int) -> dict[str, Any]:
    """POST in stream mode: time to the first complete SSE frame; each stream is read to its
    final event before the next one starts."""
    token = stack.key("bench-stream")

    async def run() -> list[float]:
        samples = []
        for i in range(count):
            envelope = {"capability": "echo", "payload": {"i": i}, "reply_mode": "stream"}
            first_s, frames = await _stream(
                stack.port, loadgen.post(stack.port, "/tasks", token, envelope)
            )
            events = [frame.get("event") for _, frame in frames]
            if events[-1:] != ["succeeded"]:
                raise RuntimeError(f"stream {i} ended with {events}")
            samples.append(first_s)
        return samples

    return latency_ms(asyncio.run(run()), (50, 95))


def emit_to_frame(stack: Stack, count: int) -> dict[str, Any]:
    """Each output event's ``at`` (when the worker appended it) to the moment its frame
    arrived here; one machine, one clock."""
    token = stack.key("bench-emit")
    payload = {"text": TEXT, "max_sentences": 5, "delay_s": 0.02}
    envelope = {"capability": "text.summarize", "payload": payload, "reply_mode": "stream"}
    raw = loadgen.post(stack.port, "/tasks", token, envelope)

    async def run() -> list[float]:
        samples = []
        for _ in range(count):
            _, frames = await _stream(stack.port, raw)
            samples += [
                arrived_at - frame["data"]["at"]
                for arrived_at, frame in frames
                if frame.get("event") == "output"
            ]
        return samples

    samples = asyncio.run(run())
    if len(samples) != 5 * count:
        raise RuntimeError(f"expected {5 * count} output events, got {len(samples)}")
    return latency_ms(samples, (50, 95))


def accept(stack: Stack, connections: int, requests: int) -> dict[str, Any]:
    token = stack.key(f"bench-accept-{connections}")
    envelope = {"capability": "echo", "payload": {"i": 0}}
    figures = asyncio.run(
        loadgen.accept_rate(stack.port, token, envelope, connections=connections, requests=requests)
    )
    figures.pop("started_at")
    return figures


def hold_streams(stack: Stack, count: int, hold_s: float) -> dict[str, Any]:
    token = stack.key("bench-streams")
    envelope = {"capability": "echo", "payload": {"i": 0}, "reply_mode": "stream"}
    api = psutil.Process(stack.api.pid)

    def cpu_s() -> float:
        return process_cpu_s(api)

    return asyncio.run(
        streams.hold_streams(
            stack.port,
            token,
            envelope,
            streams=count,
            hold_s=hold_s,
            rss_bytes=lambda: int(api.memory_info().rss),
            cpu_s=cpu_s,
        )
    )
