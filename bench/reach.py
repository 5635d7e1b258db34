"""Agent-Reach measured end to end: the real API (uvicorn, one process) and a real worker.

Figures: HTTP submit to ``succeeded`` in Postgres for N tasks; the sync round trip; time to
the first SSE frame in stream mode; emit-to-frame latency of agent outputs; the accept rate of
``POST /tasks`` alone (the worker stops consuming, the queue fills); SSE streams held open with
the API's memory.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import httpx
import psutil
import psycopg
from celery import Celery
from celery.utils.nodenames import host_format

from bench import loadgen
from bench.environment import Stores
from bench.plan import Plan
from bench.processes import (
    BIN,
    Child,
    Children,
    celery_worker,
    child_env,
    free_port,
    wait_until,
)
from bench.stats import latency_ms, rate
from broker import keys
from broker.db.engines import sync_engine
from broker.settings import Settings

WORKER = "bench-reach"
QUEUES = "echo,text.summarize"
FINAL = {"succeeded", "failed", "cancelled", "expired"}
WAIT_LIMIT_S = 600
RATE_LIMIT_OFF = 10**9
POLL_S = 0.01
# Eight short sentences; the summarizer streams the five it keeps as output events.
TEXT = " ".join(
    f"Sentence {i} says agents route tasks through queues and workers." for i in range(1, 9)
)


@dataclass
class Stack:
    api: Child
    worker: Child
    port: int
    stores: Stores

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def key(self, tenant: str) -> str:
        """A new API key (allowed everything) for a tenant of its own, one per figure, so each
        figure counts only its own tasks."""
        engine = sync_engine(Settings(database_url=self.stores.database_url), pool_size=1)
        try:
            return keys.create_key(engine, tenant, ["*"])[1]
        finally:
            engine.dispose()


def measure(
    stores: Stores, children: Children, plan: Plan, progress: Callable[[str], None]
) -> dict[str, Any]:
    with running_stack(stores, children, plan.concurrency) as stack:
        figures: dict[str, Any] = {"api_rss_idle_mb": _rss_mb(stack.api)}
        progress(f"Agent-Reach: throughput ({plan.tasks} tasks, {plan.submitters} submitters)")
        figures["throughput"] = throughput(stack, plan.tasks, plan.submitters)
        progress(f"Agent-Reach: sync round trip ({plan.round_trips} sequential)")
        figures["sync_round_trip"] = sync_round_trip(stack, plan.round_trips)
        progress(f"Agent-Reach: stream time to first event ({plan.stream_trips} sequential)")
        figures["stream_first_event"] = stream_first_event(stack, plan.stream_trips)
        progress(f"Agent-Reach: emit-to-frame latency ({plan.emit_tasks} streamed tasks)")
        figures["emit_to_frame"] = emit_to_frame(stack, plan.emit_tasks)
        stop_consuming(stack, "echo")  # the queue only fills from here on
        figures["accept"] = []
        for connections, requests in zip(plan.connections, plan.accept_requests, strict=True):
            progress(f"Agent-Reach: accept rate ({requests} POSTs on {connections} connections)")
            figures["accept"].append(accept(stack, connections, requests))
            purge(stack, "echo")  # each run starts from an empty queue, below the depth bound
        progress(f"Agent-Reach: {plan.streams} SSE streams held {plan.hold_s:.0f}s")
        figures["streams"] = hold_streams(stack, plan.streams, plan.hold_s)
        return figures


@contextmanager
def running_stack(stores: Stores, children: Children, concurrency: int) -> Iterator[Stack]:
    env = child_env(
        REACH_DATABASE_URL=stores.database_url,
        REACH_REDIS_URL=stores.redis_url,
        # The per-tenant rate limit is a policy, not a capacity: lifted so that the figures
        # show what the API can take. Everything else runs with its defaults.
        REACH_RATE_LIMIT_PER_S=str(RATE_LIMIT_OFF),
        REACH_RATE_LIMIT_BURST=str(RATE_LIMIT_OFF),
    )
    port = free_port()
    api = children.start(
        "api",
        [
            str(BIN / "uvicorn"),
            "api.app:create_app_from_env",
            "--factory",
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            "--no-access-log",
            "--log-level",
            "warning",
        ],
        env,
    )
    worker = celery_worker(children, WORKER, "workers", QUEUES, concurrency, env)
    stack = Stack(api=api, worker=worker, port=port, stores=stores)
    wait_until(lambda: _healthy(stack.url), timeout_s=60, what="waiting for the API", child=api)
    token = stack.key("bench-warmup")
    with httpx.Client(base_url=stack.url, headers=_auth(token), timeout=30) as http:
        wait_until(
            lambda: _echo_sync(http) == 200,
            timeout_s=60,
            what="waiting for the worker to serve echo",
            child=worker,
        )
        for i in range(4 * concurrency):  # every pool process connected before the clock
            _echo_sync(http, i)
    yield stack
    children.stop(api)
    children.stop(worker)


def _auth(token: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {token}"}


def _healthy(url: str) -> bool:
    try:
        return httpx.get(f"{url}/healthz", timeout=1).status_code == 200
    except httpx.HTTPError:
        return False


def _echo_sync(http: httpx.Client, i: int = 0) -> int:
    envelope = {"capability": "echo", "payload": {"i": i}, "reply_mode": "sync"}
    return http.post("/tasks", json=envelope).status_code


def _rss_mb(child: Child) -> float:
    return round(psutil.Process(child.pid).memory_info().rss / 2**20, 1)


def throughput(stack: Stack, count: int, submitters: int) -> dict[str, Any]:
    """N echo tasks submitted over HTTP on ``submitters`` concurrent connections, then
    Postgres watched until all of them are ``succeeded``."""
    tenant = "bench-throughput"
    token = stack.key(tenant)
    envelope = {"capability": "echo", "payload": {"i": 0}}
    submitted = asyncio.run(
        loadgen.accept_rate(stack.port, token, envelope, connections=submitters, requests=count)
    )
    waited_from = time.perf_counter()
    counts = wait_final(stack.stores.libpq_url, tenant, submitted["accepted"])
    elapsed = submitted["elapsed_s"] + time.perf_counter() - waited_from
    succeeded = counts.get("succeeded", 0)
    return {
        "tasks": count,
        "accepted": submitted["accepted"],
        "submit_statuses": submitted["statuses"],
        "succeeded": succeeded,
        "final_statuses": counts,
        "submit_s": submitted["elapsed_s"],
        "submit_per_s": submitted["accepted_per_s"],
        "elapsed_s": round(elapsed, 3),
        "tasks_per_s": rate(succeeded, elapsed),
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
    token = stack.key("bench-sync")

    async def run() -> list[float]:
        samples: list[float] = []
        conn = await loadgen.Connection(stack.port).open()
        try:
            for i in range(count):
                envelope = {"capability": "echo", "payload": {"i": i}, "reply_mode": "sync"}
                raw = loadgen.post(stack.port, "/tasks", token, envelope)
                sent = time.perf_counter()
                response = await conn.request(raw)
                samples.append(time.perf_counter() - sent)
                task = json.loads(response.body)
                if response.status != 200 or task.get("result") != {"i": i}:
                    raise RuntimeError(f"sync echo answered {response.status}: {task}")
        finally:
            await conn.close()
        return samples

    return latency_ms(asyncio.run(run()))


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


def stop_consuming(stack: Stack, queue: str) -> None:
    """The worker stays up and its lease live (so routing works as usual), but stops taking
    ``queue``'s messages: accepted tasks stay queued."""
    control = Celery("bench-control", broker=stack.stores.redis_url, set_as_current=False)
    try:
        node = host_format(f"{WORKER}@%h")
        replies = control.control.cancel_consumer(queue, destination=[node], reply=True, timeout=5)
        if not replies:
            raise RuntimeError(f"{node} did not confirm it stopped consuming {queue}")
    finally:
        control.close()


def purge(stack: Stack, queue: str) -> None:
    control = Celery("bench-control", broker=stack.stores.redis_url, set_as_current=False)
    try:
        with control.connection_for_write() as conn:
            conn.default_channel.queue_purge(queue)
    finally:
        control.close()


def accept(stack: Stack, connections: int, requests: int) -> dict[str, Any]:
    token = stack.key(f"bench-accept-{connections}")
    envelope = {"capability": "echo", "payload": {"i": 0}}
    return asyncio.run(
        loadgen.accept_rate(stack.port, token, envelope, connections=connections, requests=requests)
    )


def hold_streams(stack: Stack, streams: int, hold_s: float) -> dict[str, Any]:
    token = stack.key("bench-streams")
    envelope = {"capability": "echo", "payload": {"i": 0}, "reply_mode": "stream"}
    api = psutil.Process(stack.api.pid)

    def cpu_s() -> float:
        times = api.cpu_times()
        return float(times.user + times.system)

    return asyncio.run(
        loadgen.hold_streams(
            stack.port,
            token,
            envelope,
            streams=streams,
            hold_s=hold_s,
            rss_bytes=lambda: int(api.memory_info().rss),
            cpu_s=cpu_s,
        )
    )
