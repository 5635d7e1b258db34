"""Postgres going away from the API while a submit waits, or a stream is open, after the task
was accepted: the task runs (the worker's Postgres is another way in), so its caller must be
able to find it.

A sync submit cut by the outage answers 202 with the task as accepted, not 503 with no task
id: a caller told 503 submits again, and the work runs twice. An open stream outlives a short
outage (it pings, reads again at its next quiet spell) and ends with the final event: before,
its connection was cut mid-chunk and the API logged a 500.

A2A blocking messages and MCP tool calls wait the same way and answer the task as accepted
too, not an error.

A loopback proxy stands between the API and Postgres (the API here caches no key, so every
look at it goes there); the session's worker reaches Postgres directly.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import threading
from collections.abc import Callable, Iterator
from typing import TypeVar

import pytest
from a2a.types import SendMessageRequest, TaskState
from mcp_types import CallToolResult
from sqlalchemy import Engine, make_url, text

from api.app import create_app
from broker.settings import Settings
from tests.eventually import eventually
from tests.integration.conftest import KeyMaker, client_for
from tests.integration.stack import ServedApp, wait_for_task
from tests.integration.test_a2a_facade import Clients, collect, message
from tests.integration.test_lost_replies import WithholdingProxy, pipe
from tests.integration.test_mcp import connected
from tests.integration.test_replies import frames

pytestmark = pytest.mark.usefixtures("worker")

FINAL = {"succeeded", "failed", "cancelled", "expired"}
SLEEP = {"sleep_s": 4}
SLEEPY = {"capability": "test.sleepy", "payload": SLEEP}
PING_EVERY_S = {"sse_ping_s": 1}  # a stream's quiet spells, and its pings, a second apart
T = TypeVar("T")


class CuttableProxy(WithholdingProxy):
    """TCP to Postgres, on the thread and loop of ``test_lost_replies``'s proxy: ``cut``
    drops every connection through it and refuses new ones until ``restore``."""

    def __init__(self, database_url: str) -> None:
        super().__init__(database_url)
        self.url = (
            make_url(database_url)
            .set(host="127.0.0.1", port=self.port)
            .render_as_string(hide_password=False)
        )
        self.up = threading.Event()
        self.up.set()
        self.open: set[asyncio.StreamWriter] = set()  # touched on the proxy's loop only

    def cut(self) -> None:
        self.up.clear()
        asyncio.run_coroutine_threadsafe(self._drop_all(), self.loop).result(timeout=10)

    def restore(self) -> None:
        self.up.set()

    async def _drop_all(self) -> None:
        for writer in list(self.open):
            writer.transport.abort()

    async def _serve(self, client_r: asyncio.StreamReader, client_w: asyncio.StreamWriter) -> None:
        if not self.up.is_set():
            client_w.transport.abort()
            return
        pg_r, pg_w = await asyncio.open_connection(*self.upstream)
        ends = {client_w, pg_w}
        self.open |= ends

        try:
            await asyncio.gather(pipe(client_r, pg_w), pipe(pg_r, client_w))
        finally:
            self.open -= ends


@pytest.fixture
def cut_api(settings: Settings) -> Iterator[tuple[ServedApp, CuttableProxy]]:
    """The API, its Postgres through the proxy."""
    proxy = CuttableProxy(settings.database_url)
    with proxy:
        tuned = {"database_url": proxy.url, "key_cache_s": 0, **PING_EVERY_S}
        with ServedApp(create_app(settings.model_copy(update=tuned))) as served:
            yield served, proxy
        proxy.restore()


class Kept(logging.Handler):
    """The records at ``level`` and above that ``keep`` takes."""

    def __init__(self, level: int, keep: Callable[[logging.LogRecord], bool]) -> None:
        super().__init__(level)
        self.keep = keep
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        if self.keep(record):
            self.records.append(record)


@pytest.fixture
def errors_logged() -> Iterator[list[logging.LogRecord]]:
    """The records of level ERROR and above logged while the test runs."""
    kept = Kept(logging.ERROR, lambda _: True)
    root = logging.getLogger()
    root.addHandler(kept)
    yield kept.records
    root.removeHandler(kept)


@pytest.fixture
def stream_failures() -> Iterator[list[logging.LogRecord]]:
    """The records of a stream's failed reads logged while the test runs."""
    kept = Kept(logging.INFO, lambda record: record.getMessage().startswith("stream of task"))
    logger = logging.getLogger("reach.replies")
    level = logger.level
    logger.setLevel(logging.INFO)
    logger.addHandler(kept)
    yield kept.records
    logger.removeHandler(kept)
    logger.setLevel(level)


def status_of(engine: Engine, tenant: str) -> tuple[str, int] | None:
    """The status and attempts of the tenant's one task, read from Postgres directly."""
    with engine.connect() as conn:
        row = conn.execute(
            text("SELECT status, attempts FROM tasks WHERE tenant = :t"), {"t": tenant}
        ).one_or_none()
    return (row.status, row.attempts) if row is not None else None


def cut_while(waiting: Callable[[], T], proxy: CuttableProxy, engine: Engine, tenant: str) -> T:
    """``waiting()`` (a call that waits for the tenant's one task) in a thread, the API's
    Postgres cut once the task runs and restored once it has ended: what the call answered."""
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        answer = pool.submit(waiting)
        eventually(lambda: status_of(engine, tenant), "the task to run", until=_running)
        proxy.cut()
        try:
            eventually(lambda: status_of(engine, tenant), "the task to end", until=_ended)
        finally:
            proxy.restore()
        return answer.result(timeout=60)


def test_a_sync_submit_whose_wait_postgres_leaves_is_answered_as_accepted_and_runs_once(
    cut_api: tuple[ServedApp, CuttableProxy], make_key: KeyMaker, engine: Engine
) -> None:
    served, proxy = cut_api
    tenant, token = make_key()
    with client_for(served, token) as http:
        # given a sync submit accepted, its task running, when the API's Postgres goes away
        # while it waits, until the task has ended
        envelope = {**SLEEPY, "reply_mode": "sync"}
        answer = cut_while(lambda: http.post("/tasks", json=envelope), proxy, engine, tenant)
        # expect the task as accepted, to poll (before: 503 with no task id)
        assert answer.status_code == 202, answer.text
        task_id = answer.json()["task_id"]
        assert answer.headers["Location"] == f"/tasks/{task_id}"
        assert answer.json()["status"] not in FINAL
        # and the task, polled, ran once
        done = wait_for_task(http, task_id, FINAL)
    assert done["status"] == "succeeded", done
    assert status_of(engine, tenant) == ("succeeded", 1)


def test_an_a2a_blocking_message_whose_wait_postgres_leaves_answers_the_task_as_accepted(
    cut_api: tuple[ServedApp, CuttableProxy], make_key: KeyMaker, engine: Engine
) -> None:
    served, proxy = cut_api
    tenant, _ = make_key()  # the A2A client's key is another of this tenant's
    a2a = Clients(served, make_key)
    answered: list[int] = []

    async def send() -> None:
        client, _ = await a2a(tenant=tenant)
        sent = message("test.sleepy", data=SLEEP)
        events = await collect(client.send_message(SendMessageRequest(message=sent)))
        answered.append(events[-1].task.status.state)

    # given a blocking message's task running, when the API's Postgres goes away meanwhile
    cut_while(lambda: a2a.run(send), proxy, engine, tenant)
    # expect the task as accepted (before: an error)
    assert answered == [TaskState.TASK_STATE_SUBMITTED]
    eventually(lambda: status_of(engine, tenant), "the task to end", until=_ended)
    assert status_of(engine, tenant) == ("succeeded", 1)


def test_an_mcp_tool_call_whose_wait_postgres_leaves_answers_the_task_to_poll(
    cut_api: tuple[ServedApp, CuttableProxy], make_key: KeyMaker, engine: Engine
) -> None:
    served, proxy = cut_api
    tenant, token = make_key()

    async def call() -> CallToolResult:
        async with connected(served, token) as client:
            await client.list_tools()  # before the outage: the answer is checked against them
            answer = await client.call_tool("test.sleepy", SLEEP)
            await asyncio.to_thread(proxy.up.wait)  # its session's end needs Postgres
            return answer

    # given a tool call's task running, when the API's Postgres goes away meanwhile
    answer = cut_while(lambda: asyncio.run(call()), proxy, engine, tenant)
    # expect its task id to poll, not a tool error (before: service_unavailable)
    assert not answer.is_error, answer
    content = answer.structured_content
    assert isinstance(content, dict) and content["status"] not in FINAL, content
    with client_for(served, token) as http:
        done = wait_for_task(http, str(content["task_id"]), FINAL)
    assert done["status"] == "succeeded", done
    assert status_of(engine, tenant) == ("succeeded", 1)


def test_an_open_stream_outlives_a_short_postgres_outage_and_ends_with_the_final_event(
    cut_api: tuple[ServedApp, CuttableProxy],
    make_key: KeyMaker,
    engine: Engine,
    errors_logged: list[logging.LogRecord],
) -> None:
    served, proxy = cut_api
    tenant, token = make_key()
    # given an open stream, when the API's Postgres goes away for two pings while the task
    # runs (each ping followed a look at the key: none is cached), expect the stream to go on
    # and end with the task's final event
    assert streamed_through_outage(served, proxy, token) == ["succeeded"]
    assert status_of(engine, tenant) == ("succeeded", 1)
    # and no 500 in the API's log (before: "response already started", the stream cut)
    assert served_errors(errors_logged) == []


def test_an_open_stream_outlives_a_short_redis_outage_and_ends_with_the_final_event(
    settings: Settings,
    make_key: KeyMaker,
    engine: Engine,
    errors_logged: list[logging.LogRecord],
    stream_failures: list[logging.LogRecord],
) -> None:
    proxy = CuttableProxy(settings.redis_url)
    tenant, token = make_key()
    app = create_app(settings.model_copy(update={"redis_url": proxy.url, **PING_EVERY_S}))
    hub = app.state.services.hub
    with proxy, ServedApp(app) as api:
        # given an open stream, when the API's Redis (its log and pub/sub) goes away for two
        # pings while the task runs, expect the stream to go on and end with the final event
        assert streamed_through_outage(api, proxy, token) == ["succeeded"]
        # and the event hub to hold no listener of it once it ended (a subscription Redis
        # refused left its listener behind, and the channel subscribed, for good)
        eventually(lambda: hub._queues, "the hub to hold no listener", until=_empty)
    assert status_of(engine, tenant) == ("succeeded", 1)
    assert served_errors(errors_logged) == []
    # and the spell's first failed read logged as a warning with its traceback (an outage's
    # classes cover a bug's too), the ones after it as information
    assert stream_failures, "no failed read of the stream was logged"
    first, *rest = stream_failures
    assert (first.levelno, first.exc_info is not None) == (logging.WARNING, True)
    assert all(r.levelno == logging.INFO and not r.exc_info for r in rest)


def streamed_through_outage(api: ServedApp, proxy: CuttableProxy, token: str) -> list[str]:
    """The final statuses a stream of a test.sleepy task sent, its proxied store cut once the
    task runs and restored after two pings."""
    envelope = {"capability": "test.sleepy", "payload": {"sleep_s": 8}}
    with client_for(api, token) as http:
        task_id = http.post("/tasks", json=envelope).json()["task_id"]
        with http.stream("GET", f"/tasks/{task_id}/events") as response:
            assert response.status_code == 200
            seen, pinged = [], 0
            for frame in frames(response.iter_lines()):
                seen.append(frame)
                if frame.get("event") == "status" and _data(frame)["status"] == "running":
                    proxy.cut()
                elif "comment" in frame and not proxy.up.is_set():
                    pinged += 1
                    if pinged == 2:
                        proxy.restore()
    assert pinged == 2, seen
    return [str(_data(f)["status"]) for f in seen if f.get("event") in FINAL]


def served_errors(logged: list[logging.LogRecord]) -> list[str]:
    """What the API logged as a failed request (a 500, an exception in the ASGI app)."""
    return [r.getMessage() for r in logged if r.name in ("reach.api", "uvicorn.error")]


def _data(frame: dict[str, object]) -> dict[str, object]:
    data = frame["data"]
    assert isinstance(data, dict)
    inner = data["data"]
    assert isinstance(inner, dict)
    return inner


def _empty(held: dict[str, object]) -> bool:
    return not held


def _running(found: tuple[str, int] | None) -> bool:
    return found is not None and found[0] == "running"


def _ended(found: tuple[str, int] | None) -> bool:
    return found is not None and found[0] in FINAL


def test_a_cancel_whose_redis_is_away_after_its_commit_answers_the_cancelled_task(
    settings: Settings, make_key: KeyMaker, engine: Engine
) -> None:
    """It answered 503: its caller was told the cancel was not applied, and a retry found
    the task final (409 ``task_final``)."""
    proxy = CuttableProxy(settings.redis_url)
    tenant, token = make_key()
    app = create_app(settings.model_copy(update={"redis_url": proxy.url}))
    with proxy, ServedApp(app) as api, client_for(api, token) as http:
        task_id = http.post("/tasks", json=SLEEPY).json()["task_id"]
        eventually(lambda: status_of(engine, tenant), "the task to run", until=_running)
        # When the API's Redis goes away and the task is cancelled
        proxy.cut()
        try:
            answer = http.post(f"/tasks/{task_id}/cancel")
        finally:
            proxy.restore()
        # Then the answer is the cancelled task
        assert answer.status_code == 200, answer.text
        assert answer.json()["status"] == "cancelled"
        # and it is so: a cancel sent again finds it final
        again = http.post(f"/tasks/{task_id}/cancel")
        assert (again.status_code, again.json()["code"]) == (409, "task_final")
    assert status_of(engine, tenant) == ("cancelled", 1)
