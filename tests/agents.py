"""Agents that exist only for the tests, loaded by the test workers via REACH_AGENTS."""

from __future__ import annotations

import asyncio
import gc
import logging
import os
import random
import signal
import sys
import threading
import time
from collections.abc import AsyncIterator, Iterator
from typing import Any

import redis

from broker.observability import logs
from workers.sdk import (
    AgentFailure,
    Context,
    EventsTooLarge,
    Retryable,
    SessionConflict,
    agent,
)


@agent.capability("test.runtime", agent_id="test-runtime", version="0.0.1")
def runtime_settings(ctx: Context, payload: dict[str, Any]) -> dict[str, Any]:
    """What the interpreter running the handler was set to (``broker.runtime``)."""
    return {"gc_threshold": list(gc.get_threshold()), "pid": os.getpid()}


@agent.capability("test.runtime-loop", agent_id="test-runtime-loop", version="0.0.1")
async def runtime_loop(ctx: Context, payload: dict[str, Any]) -> dict[str, Any]:
    """The kind of event loop running the async handler (``broker.runtime``)."""
    loop = type(asyncio.get_running_loop())
    return {"loop": f"{loop.__module__}.{loop.__qualname__}", "pid": os.getpid()}


@agent.capability("test.boom", agent_id="test-boom", version="0.0.1")
def boom(ctx: Context, payload: dict[str, Any]) -> dict[str, Any]:
    raise RuntimeError("the agent broke")


@agent.capability("test.not-json", agent_id="test-not-json", version="0.0.1")
def not_json(ctx: Context, payload: dict[str, Any]) -> object:
    """A set, NaN (which Python's json would write, and Postgres refuse), or a NUL in a
    tuple (written as an array; the check of strings went into dicts and lists only)."""
    if payload.get("nul_in_tuple"):
        return {"t": ("a\x00",)}
    return {"x": float("nan")} if payload.get("nan") else {"a set": {1, 2}}


@agent.capability("test.context", agent_id="test-context", version="0.0.2")
def context(ctx: Context, payload: dict[str, Any]) -> dict[str, Any]:
    """Returns what the handler was told about its task."""
    return {
        "task_id": str(ctx.task_id),
        "trace_id": ctx.trace_id,
        "attempt": ctx.attempt,
        "time_left_s": ctx.time_left_s(),
        "session_id": ctx.session_id,
        "session": None if ctx.session is None else ctx.session.revision,
        "metadata": ctx.metadata,
    }


@agent.capability(
    "test.pool",
    agent_id="test-pool",
    # Two workers of one test run as two versions of the agent, each with its own weight.
    version=os.environ.get("REACH_TEST_POOL_VERSION", "1.0.0"),
    weight=float(os.environ.get("REACH_TEST_POOL_WEIGHT", "1")),
    input_schema={"type": "object", "properties": {"sleep_s": {"type": "number", "maximum": 30}}},
)
def pool(ctx: Context, payload: dict[str, Any]) -> dict[str, Any]:
    """Sleeps ``sleep_s`` (reporting progress), or pauses its capability with ``not_ready_s``."""
    if "not_ready_s" in payload:
        ctx.not_ready(for_s=payload["not_ready_s"])
        return {"paused_for_s": payload["not_ready_s"]}
    sleep_s = float(payload.get("sleep_s", 0))
    ctx.progress(0, "started")
    time.sleep(sleep_s)
    return {"slept_s": sleep_s}


@agent.capability(
    "test.addr",
    agent_id="test-addr",
    # The address tests run workers of several versions of this agent, some of them private.
    version=os.environ.get("REACH_TEST_ADDR_VERSION", "1.0.0"),
    tenants=os.environ["REACH_TEST_ADDR_TENANTS"].split(",")
    if os.environ.get("REACH_TEST_ADDR_TENANTS")
    else None,
)
def addressed(ctx: Context, payload: dict[str, Any]) -> dict[str, Any]:
    """Answers at once: which version ran it is the task's ``agent``."""
    return {}


@agent.capability("test.hidden", agent_id="test-hidden", version="1.0.0", tenants=["hidden-owner"])
def hidden(ctx: Context, payload: dict[str, Any]) -> dict[str, Any]:
    """Only the tenant ``hidden-owner`` may use or see it."""
    return {}


@agent.capability("test.late", agent_id="test-late", version="0.0.1")
def late(ctx: Context, payload: dict[str, Any]) -> dict[str, Any]:
    return {"ran": True}


# Each served by a one-slot worker of its own (prefork, threads), started once its queue holds
# the tasks of a test: their order is the order the worker takes them in.
@agent.capability("test.fair-prefork", agent_id="test-fair-prefork", version="0.0.1")
@agent.capability("test.fair-threads", agent_id="test-fair-threads", version="0.0.1")
def fair(ctx: Context, payload: dict[str, Any]) -> dict[str, Any]:
    return payload


# Served by a one-process worker of its own: every task of a test runs in the same process.
@agent.capability("test.solo", agent_id="test-solo", version="0.0.1")
def solo(ctx: Context, payload: dict[str, Any]) -> dict[str, Any]:
    return payload


@agent.capability("test.gen", agent_id="test-gen", version="0.0.1", streaming=True)
def generate(ctx: Context, payload: dict[str, Any]) -> Iterator[dict[str, int]]:
    """A generator handler: each yielded item is an output event."""
    for i in range(int(payload.get("n", 3))):
        yield {"i": i}


@agent.capability("test.flood", agent_id="test-flood", version="0.0.1", streaming=True)
def flood(ctx: Context, payload: dict[str, Any]) -> dict[str, Any]:
    """Emits ``n`` outputs of ``size`` characters: enough to fill a socket that nobody reads.
    With ``catch``, stops at the first output past the task's budget and returns what it sent;
    with ``result_size``, returns that many characters as well."""
    n, size = int(payload.get("n", 10)), int(payload.get("size", 1000))
    sent = 0
    for i in range(n):
        try:
            ctx.emit({"i": i, "blob": "x" * size})
        except EventsTooLarge:
            if not payload.get("catch"):
                raise
            break
        sent += 1
    return {"chunks": sent, "blob": "x" * int(payload.get("result_size", 0))}


def _runs(ctx: Context) -> int:
    """Counts every time a handler starts for this task, in Redis, so a test can tell how
    often it really ran."""
    client = redis.Redis.from_url(os.environ["REACH_REDIS_URL"])
    return int(client.incr(f"reach:test:runs:{ctx.task_id}"))


@agent.capability("test.flaky", agent_id="test-flaky", version="0.0.1", max_attempts=5)
def flaky(ctx: Context, payload: dict[str, Any]) -> dict[str, int]:
    """Raises Retryable on its first ``fail_times`` attempts, asking for ``delay_s`` (0.05 s,
    given as it came: text too)."""
    if ctx.attempt <= int(payload.get("fail_times", 1)):
        delay_s = payload.get("delay_s", 0.05)
        raise Retryable(f"not yet (attempt {ctx.attempt})", code="upstream_busy", delay_s=delay_s)
    return {"attempt": ctx.attempt}


@agent.capability("test.flaky-io", agent_id="test-flaky-io", version="0.0.1", max_attempts=2)
def flaky_io(ctx: Context, payload: dict[str, Any]) -> dict[str, int]:
    """A transient infrastructure error every time."""
    raise ConnectionError("upstream refused the connection")


@agent.capability("test.sleepy", agent_id="test-sleepy", version="0.0.1", timeout_s=30)
def sleepy(ctx: Context, payload: dict[str, Any]) -> dict[str, Any]:
    """Sleeps up to ``sleep_s``, checking ``ctx.cancelled`` (cooperative cancellation); given
    a ``gate``, waits for it first (``_wait_for_gate``), having reported progress when told
    to (``progress``)."""
    _runs(ctx)
    if payload.get("progress"):
        ctx.progress(50, "at the gate")
    _wait_for_gate(payload, ctx)
    end = time.monotonic() + float(payload.get("sleep_s", 1))
    while time.monotonic() < end:
        if ctx.cancelled:
            return {"stopped": "cancelled"}
        time.sleep(0.05)
    return {"slept": True, "time_left_s": ctx.time_left_s()}


@agent.capability("test.stubborn", agent_id="test-stubborn", version="0.0.1", cancellable=True)
def stubborn(ctx: Context, payload: dict[str, Any]) -> dict[str, bool]:
    """Ignores cancellation; its card says it may be terminated. Records the process it
    runs in (``reach:test:pid:<task id>``), so a test can tell that process was stopped."""
    _runs(ctx)
    client = redis.Redis.from_url(os.environ["REACH_REDIS_URL"])
    client.set(f"reach:test:pid:{ctx.task_id}", os.getpid())
    _sleep_noting_the_end(ctx, float(payload.get("sleep_s", 30)))
    return {"finished": True}


@agent.capability("test.short-fuse", agent_id="test-short-fuse", version="0.0.1", timeout_s=0.5)
def short_fuse(ctx: Context, payload: dict[str, Any]) -> dict[str, bool]:
    """Overruns its own 0.5 s timeout."""
    _sleep_noting_the_end(ctx, 5)
    return {"finished": True}


def _sleep_noting_the_end(ctx: Context, seconds: float) -> None:
    """Sleeps, and notes how the sleep ended (``reach:test:slept:<task id>``): ``finished``,
    or the name of the exception that interrupted it, so a test can tell a handler stopped
    at its time limit from one that ran to its end and came back late."""
    client = redis.Redis.from_url(os.environ["REACH_REDIS_URL"])
    key = f"reach:test:slept:{ctx.task_id}"
    try:
        time.sleep(seconds)
    except BaseException as exc:
        client.set(key, type(exc).__name__)
        raise
    client.set(key, "finished")


@agent.capability("test.slow-idem", agent_id="test-slow-idem", version="0.0.1", idempotent=True)
def slow_idempotent(ctx: Context, payload: dict[str, Any]) -> dict[str, int]:
    runs = _runs(ctx)
    time.sleep(float(payload.get("sleep_s", 2)))
    return {"runs": runs}


@agent.capability(
    "test.stale-attempt", agent_id="test-stale-attempt", version="0.0.1", idempotent=True
)
def stale_attempt(ctx: Context, payload: dict[str, Any]) -> dict[str, int]:
    """Each attempt reports progress and an output as it starts. The first then sleeps
    ``first_s``, reports again, says so in Redis and fails; a later one sleeps ``later_s``
    and succeeds."""
    ctx.progress(10, f"attempt {ctx.attempt} began")
    ctx.emit({"attempt": ctx.attempt, "at": "start"})
    client = redis.Redis.from_url(os.environ["REACH_REDIS_URL"])
    client.incr(f"reach:test:runs:{ctx.task_id}")  # after its first events: tests wait for it
    if ctx.attempt == 1:
        time.sleep(float(payload["first_s"]))
        ctx.progress(90, "attempt 1 woke")
        ctx.emit({"attempt": 1, "at": "late"})
        client.set(f"reach:test:stale-done:{ctx.task_id}", 1, ex=300)
        raise AgentFailure("the first attempt's late failure", code="stale_attempt")
    time.sleep(float(payload["later_s"]))
    return {"attempt": ctx.attempt}


@agent.capability("test.slow-once", agent_id="test-slow-once", version="0.0.1")
def slow_once(ctx: Context, payload: dict[str, Any]) -> dict[str, int]:
    runs = _runs(ctx)
    time.sleep(float(payload.get("sleep_s", 2)))
    return {"runs": runs}


HANG_READINESS_KEY = "reach:test:hang-readiness"


def _hangs_while_told() -> bool:
    """A readiness probe of a dependency that stopped answering, with no timeout of its
    own: it does not return while ``HANG_READINESS_KEY`` exists."""
    with redis.Redis.from_url(os.environ["REACH_REDIS_URL"]) as client:
        while client.exists(HANG_READINESS_KEY):
            time.sleep(0.05)
    return True


# Served only by the worker of the test that hangs its readiness (``test_lease_keeper_faults``).
agent.capability(
    "test.hung-ready", agent_id="test-hung-ready", version="0.0.1", readiness=_hangs_while_told
)(slow_once)

SLOW_READINESS_ANSWERS_KEY = "reach:test:slow-readiness-answers"


def _ready_slowly() -> bool:
    """A readiness probe slower than a lease renewal (TTL/3) but within the TTL: two thirds
    of it, a remote health check on a slow day. Counts its answers in Redis."""
    time.sleep(2 / 3 * float(os.environ["REACH_LEASE_TTL_S"]))
    with redis.Redis.from_url(os.environ["REACH_REDIS_URL"]) as client:
        client.incr(SLOW_READINESS_ANSWERS_KEY)
    return True


# Served only by the worker of the test of a slow readiness check (``test_lease_keeper_faults``).
agent.capability(
    "test.slow-ready", agent_id="test-slow-ready", version="0.0.1", readiness=_ready_slowly
)(slow_once)


@agent.capability(
    "test.poison", agent_id="test-poison", version="0.0.1", idempotent=True, max_attempts=2
)
def poison(ctx: Context, payload: dict[str, Any]) -> dict[str, bool]:
    """Kills the process running it, every time."""
    _runs(ctx)
    os.kill(os.getpid(), signal.SIGKILL)
    return {"survived": True}


# --- async handlers: run on the worker process's event loop (``-P threads``) ------------------

_barriers: dict[str, tuple[list[int], asyncio.Event]] = {}


@agent.capability("test.async", agent_id="test-async", version="0.0.1", timeout_s=20)
async def async_sleep(ctx: Context, payload: dict[str, Any]) -> dict[str, Any]:
    """Awaits ``sleep_s``. With ``barrier`` and ``n``, first waits until ``n`` tasks of that
    barrier are in flight in this process at once (or fails after ``wait_s``), and counts the
    process's threads then. With ``mark``,
    writes to that Redis key whether its coroutine was cancelled. With ``sync_progress``, first
    reports progress with the sync ``ctx.progress``, as a handler ported from sync code may."""
    peers = threads = 0
    if payload.get("sync_progress"):
        ctx.progress(0, "started, reported the sync way")
    if ctx.attempt <= int(payload.get("fail_times", 0)):
        raise Retryable(f"not yet (attempt {ctx.attempt})", code="upstream_busy", delay_s=0.05)
    try:
        if "barrier" in payload:
            arrived, everyone = _barriers.setdefault(payload["barrier"], ([0], asyncio.Event()))
            arrived[0] += 1
            if arrived[0] >= int(payload["n"]):
                everyone.set()
            await asyncio.wait_for(everyone.wait(), float(payload.get("wait_s", 120)))
            peers = arrived[0]
            threads = threading.active_count()
        await asyncio.sleep(float(payload.get("sleep_s", 0)))
    except asyncio.CancelledError:
        if "mark" in payload:
            await asyncio.to_thread(_mark, payload["mark"], "cancelled")
        raise
    return {
        "peers": peers,
        "pid": os.getpid(),
        "cancelled_seen": ctx.cancelled,
        "threads": threads,  # the process's threads with all of the barrier's in flight
    }


def _mark(key: str, value: str) -> None:
    redis.Redis.from_url(os.environ["REACH_REDIS_URL"]).set(key, value, ex=300)


@agent.capability("test.async-fuse", agent_id="test-async-fuse", version="0.0.1", timeout_s=0.5)
async def async_fuse(ctx: Context, payload: dict[str, Any]) -> dict[str, bool]:
    """Overruns its own 0.5 s timeout; marks ``mark`` when its coroutine is cancelled."""
    try:
        await asyncio.sleep(10)
    except asyncio.CancelledError:
        await asyncio.to_thread(_mark, payload["mark"], "cancelled")
        raise
    return {"finished": True}


@agent.capability("test.async-stream", agent_id="test-async-stream", version="0.0.1")
async def async_stream(ctx: Context, payload: dict[str, Any]) -> AsyncIterator[dict[str, Any]]:
    """An async generator: each item an output event. Between awaits it reports the trace id
    its log context holds (a context variable), and logs a line naming its own task, so a
    test can tell whether one task's context leaked into another's. With ``size``, each item
    carries that many characters too; with ``early_size``, it first emits that many the sync
    way, before its first await."""
    if "early_size" in payload:  # the sync way, before its running event is out
        ctx.emit({"blob": "z" * int(payload["early_size"])})
    for i in range(int(payload.get("n", 3))):
        await asyncio.sleep(random.uniform(0, float(payload.get("jitter_s", 0))))
        logging.getLogger("reach.test").info("step", extra={"own_task": str(ctx.task_id)})
        item = {"i": i, "bound_trace_id": logs.current().get("trace_id")}
        yield {**item, "blob": "x" * int(payload["size"])} if "size" in payload else item
        if payload.get("progress"):
            await ctx.progress_async((i + 1) * 100 / int(payload.get("n", 3)), f"item {i}")


class _Replier:
    """A handler that is an object whose ``__call__`` is an ``async def``."""

    async def __call__(self, ctx: Context, payload: dict[str, Any]) -> dict[str, Any]:
        await asyncio.sleep(0.01)  # it answers only if it was awaited
        return {"replied": payload.get("text")}


agent.capability("test.async-callable", agent_id="test-async-callable")(_Replier())
# A sync handler that returns a coroutine: nothing awaits it
agent.capability("test.async-wrapped", agent_id="test-async-wrapped")(
    lambda ctx, payload: _Replier()(ctx, payload)
)


@agent.capability("test.sync-stream", agent_id="test-sync-stream", timeout_s=120)
def sync_stream(ctx: Context, payload: dict[str, Any]) -> Iterator[dict[str, int]]:
    """A sync generator that yields every 0.1 s for a minute; marks ``mark`` with how many
    it yielded when it is closed."""
    i = 0
    try:
        for i in range(600):
            yield {"i": i}
            time.sleep(0.1)
    finally:
        _mark(payload["mark"], str(i + 1))


@agent.capability("test.sync-slow", agent_id="test-sync-slow", version="0.0.1")
def sync_slow(ctx: Context, payload: dict[str, Any]) -> dict[str, Any]:
    """A sync handler that sleeps ``sleep_s`` without looking at its deadline, then fails
    with ``fail`` as its error code when that is given."""
    time.sleep(float(payload.get("sleep_s", 1)))
    if payload.get("fail"):
        raise AgentFailure("failed after its sleep", code=str(payload["fail"]))
    return {"slept_s": payload.get("sleep_s", 1)}


@agent.capability("test.sync-fuse", agent_id="test-sync-fuse", version="0.0.1", timeout_s=0.5)
def sync_fuse(ctx: Context, payload: dict[str, Any]) -> dict[str, Any]:
    """A sync handler with half a second (its card's ``timeout_s``) that sleeps ``sleep_s``,
    then raises: ``Retryable`` with ``retry``, an ``AgentFailure`` otherwise. Counts its runs."""
    _runs(ctx)
    time.sleep(float(payload.get("sleep_s", 1)))
    if payload.get("retry"):
        raise Retryable("try me again", code="upstream_busy", delay_s=0.05)
    raise AgentFailure("failed after its sleep", code="gave_up")


async def _lives(ctx: Context, payload: dict[str, Any]) -> dict[str, Any]:
    """Counts its runs; given a ``gate``, waits for it (``_wait_for_gate``); sleeps
    ``sleep_s`` on its first attempt and hardly at all after. Given ``retry_after_s``, its
    first attempt asks to be retried after that long instead. Given ``linger_s``, a run
    cancelled takes that long to stop."""
    if ctx.attempt == 1 and "retry_after_s" in payload:
        delay_s = float(payload["retry_after_s"])
        raise Retryable("not yet", code="upstream_busy", delay_s=delay_s)
    runs = await asyncio.to_thread(_runs, ctx)
    try:
        await asyncio.to_thread(_wait_for_gate, payload, ctx)
        await asyncio.sleep(float(payload.get("sleep_s", 60)) if ctx.attempt == 1 else 0.05)
    except asyncio.CancelledError:
        await asyncio.sleep(float(payload.get("linger_s", 0)))
        raise
    return {"runs": runs, "attempt": ctx.attempt}


agent.capability("test.async-idem", agent_id="test-async-idem", idempotent=True)(_lives)
agent.capability("test.async-once", agent_id="test-async-once")(_lives)
# Served only by the worker of the test that watches it (``inspect active``): a message on a
# queue another worker also consumes may run there instead.
agent.capability("test.async-watched", agent_id="test-async-watched")(_lives)
# Served only by the worker of the test of a cancel's revoke on a threads worker.
agent.capability("test.async-revocable", agent_id="test-async-revocable", cancellable=True)(_lives)
# Served only by the worker of the test of a card's max_concurrency, beside a card of no bound.
agent.capability("test.async-bounded", agent_id="test-async-bounded", max_concurrency=2)(_lives)
agent.capability("test.async-unbounded", agent_id="test-async-unbounded")(_lives)
# Served only by the worker of the test of a tenant's share of a worker's slots.
agent.capability("test.async-share", agent_id="test-async-share")(_lives)


@agent.capability("test.sync-idem", agent_id="test-sync-idem", idempotent=True)
def sync_lives(ctx: Context, payload: dict[str, Any]) -> dict[str, Any]:
    """``_lives`` as a sync handler: a pool thread each."""
    runs = _runs(ctx)
    _wait_for_gate(payload, ctx)
    time.sleep(float(payload.get("sleep_s", 60)) if ctx.attempt == 1 else 0.05)
    return {"runs": runs, "attempt": ctx.attempt}


# --- session turns: ``ctx.session`` and the order of a session's tasks ------------------------

GATE_KEY = "reach:test:gate:{}"


def _wait_for_gate(payload: dict[str, Any], ctx: Context) -> None:
    """Until the Redis key of ``payload["gate"]`` exists (none: at once), or a cancel."""
    if "gate" not in payload:
        return
    client = redis.Redis.from_url(os.environ["REACH_REDIS_URL"])
    while not client.exists(GATE_KEY.format(payload["gate"])) and not ctx.cancelled:
        time.sleep(0.02)


def _log_turn(state: dict[str, Any], text: str) -> None:
    state.setdefault("log", []).append(text)


@agent.capability("test.turn", agent_id="test-turn", version="0.0.1", timeout_s=60)
def turn(ctx: Context, payload: dict[str, Any]) -> dict[str, Any]:
    """A session's turn. Waits until the Redis key of ``gate`` exists (or it is cancelled),
    then appends ``text`` to ``state["log"]``: with ``ctx.session.mutate`` (``write``:
    "mutate", the default), or with one ``update`` at the revision read ("update"), which
    reports a conflict instead of raising it; then fails with ``fail`` as its code if given,
    or (``retry``) retryably on its first attempt. ``sleep_s``: sleeps before the write, deaf
    to a cancel."""
    assert ctx.session is not None
    read_revision = ctx.session.revision
    _wait_for_gate(payload, ctx)
    time.sleep(payload.get("sleep_s", 0))
    outcome: dict[str, Any] = {"read_revision": read_revision}
    if "text" in payload:
        if payload.get("write", "mutate") == "update":
            state = {**ctx.session.state, "log": [*ctx.session.state.get("log", [])]}
            _log_turn(state, payload["text"])
            try:
                ctx.session.update(state)
            except SessionConflict as conflict:
                outcome["conflict"] = conflict.current_revision
        else:
            ctx.session.mutate(lambda state: _log_turn(state, payload["text"]))
    if payload.get("fail"):
        raise AgentFailure("this turn fails", code=str(payload["fail"]))
    if payload.get("retry") and ctx.attempt == 1:
        raise Retryable("this turn may be tried again", code="upstream_busy", delay_s=0.1)
    return {**outcome, "revision": ctx.session.revision, "state": ctx.session.state}


# ``test.turn`` served by one test's threads-pool worker alone (``test_session_turns``).
agent.capability("test.turn-threads", agent_id="test-turn-threads", version="0.0.1", timeout_s=60)(
    turn
)


@agent.capability("test.turn-async", agent_id="test-turn-async", version="0.0.1", timeout_s=60)
async def turn_async(ctx: Context, payload: dict[str, Any]) -> dict[str, Any]:
    """``test.turn`` as an async handler, writing with the async twins."""
    assert ctx.session is not None
    read_revision = ctx.session.revision
    await asyncio.to_thread(_wait_for_gate, payload, ctx)
    outcome: dict[str, Any] = {"read_revision": read_revision}
    if payload.get("write", "mutate") == "update":
        state = {**ctx.session.state, "log": [*ctx.session.state.get("log", [])]}
        _log_turn(state, payload["text"])
        try:
            await ctx.session.update_async(state)
        except SessionConflict as conflict:
            outcome["conflict"] = conflict.current_revision
    else:
        await ctx.session.mutate_async(lambda state: _log_turn(state, payload["text"]))
    return {**outcome, "revision": ctx.session.revision, "state": ctx.session.state}


# Served only by the workers of the loop consumer's tests (``test_loop_consumer``).
agent.capability("test.loop-consumer", agent_id="test-loop-consumer", idempotent=True)(_lives)


class LibraryAbort(BaseException):
    """A library's own ``BaseException`` (as ``gevent.Timeout`` is)."""


class Unprintable(Exception):
    """An exception whose ``str()`` raises."""

    def __str__(self) -> str:
        raise RuntimeError("str() of this exception fails")


def _raise_what(payload: dict[str, Any]) -> None:
    """``raise``: ``cancelled`` raises a ``CancelledError`` (asyncio code run from a sync
    handler, cancelled), ``base`` a ``LibraryAbort``, ``interrupt`` a ``KeyboardInterrupt``,
    ``unprintable`` an ``Unprintable``."""
    if payload.get("raise") == "cancelled":
        raise asyncio.CancelledError()
    if payload.get("raise") == "base":
        raise LibraryAbort("aborted")
    if payload.get("raise") == "interrupt":
        raise KeyboardInterrupt()
    if payload.get("raise") == "unprintable":
        raise Unprintable()


@agent.capability("test.exit", agent_id="test-exit", version="0.0.1", timeout_s=20)
def exits(ctx: Context, payload: dict[str, Any]) -> dict[str, Any]:
    """With ``exit``, calls ``sys.exit(2)``, as a library may (argparse's ``error``); with
    ``raise``, raises what ``_raise_what`` says; else sleeps ``sleep_s`` and answers."""
    if payload.get("exit"):
        sys.exit(2)
    _raise_what(payload)
    time.sleep(float(payload.get("sleep_s", 0)))
    return {"pid": os.getpid()}


# Served only by the prefork worker of ``test_handler_exits``.
agent.capability("test.exit-prefork", agent_id="test-exit-prefork", timeout_s=20, idempotent=True)(
    exits
)


@agent.capability("test.exit-async", agent_id="test-exit-async", version="0.0.1", timeout_s=20)
async def exits_async(ctx: Context, payload: dict[str, Any]) -> dict[str, Any]:
    """``test.exit`` as a coroutine; with ``cancel_itself``, awaits a sub-task of its own
    that it cancels (nobody cancels the task)."""
    await asyncio.sleep(float(payload.get("sleep_s", 0.01)))
    if payload.get("exit"):
        sys.exit(2)
    if payload.get("raise") in ("base", "unprintable"):
        _raise_what(payload)
    if payload.get("cancel_itself"):
        inner = asyncio.create_task(asyncio.sleep(5))
        await asyncio.sleep(0.01)
        inner.cancel()
        await inner
    return {"pid": os.getpid()}
