"""``reach_client`` against the running stack: the real API on uvicorn, a real Celery worker,
Postgres and Redis. Where a test needs the network to misbehave (a 503, a stream cut short),
an httpx transport in front of the real one does it; the API behind it is the real one."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import AsyncIterator, Iterator

import httpx
import pytest
from reach_client import (
    APITimeoutError,
    AsyncReach,
    AuthenticationError,
    ConfigurationError,
    ConflictError,
    Event,
    NotFoundError,
    Reach,
    RevisionConflictError,
    Task,
    WaitTimeoutError,
)
from sqlalchemy import Engine

from api.app import create_app
from broker.settings import Settings
from tests.integration.conftest import count_tasks
from tests.integration.stack import CeleryProcess, ServedApp, free_port

SUMMARY_TEXT = (
    "Queues decouple callers from agents. Agents advertise cards with their capabilities. "
    "Leases expire when a worker dies. Streams resume after a dropped connection."
)
STREAMED = {"text": SUMMARY_TEXT, "max_sentences": 4, "delay_s": 0.1}


@pytest.fixture
def account(api: ServedApp, tenant: tuple[str, str], worker: CeleryProcess) -> tuple[str, str]:
    """(API URL, key) of a fresh tenant allowed everything, with the worker running."""
    return api.url, tenant[1]


# -- transports in front of the real API ----------------------------------------------------


def _frames_until(buffer: bytes, count: int) -> int | None:
    """The end offset of the ``count``-th event frame (pings not counted) in ``buffer``."""
    seen, offset = 0, 0
    while (end := buffer.find(b"\n\n", offset)) != -1:
        if buffer[offset:end].lstrip().startswith(b"id:"):
            seen += 1
            if seen == count:
                return end + 2
        offset = end + 2
    return None


class CutStream(httpx.SyncByteStream):
    """The first ``count`` events of a real stream, then the connection drops."""

    def __init__(self, inner: httpx.SyncByteStream, count: int) -> None:
        self.inner, self.count = inner, count

    def __iter__(self) -> Iterator[bytes]:
        buffer = b""
        for chunk in self.inner:
            buffer += chunk
            if (end := _frames_until(buffer, self.count)) is not None:
                yield buffer[:end]
                raise httpx.RemoteProtocolError("peer closed connection (cut by the test)")
        yield buffer

    def close(self) -> None:
        self.inner.close()


class AsyncCutStream(httpx.AsyncByteStream):
    def __init__(self, inner: httpx.AsyncByteStream, count: int) -> None:
        self.inner, self.count = inner, count

    async def __aiter__(self) -> AsyncIterator[bytes]:
        buffer = b""
        async for chunk in self.inner:
            buffer += chunk
            if (end := _frames_until(buffer, self.count)) is not None:
                yield buffer[:end]
                raise httpx.RemoteProtocolError("peer closed connection (cut by the test)")
        yield buffer

    async def aclose(self) -> None:
        await self.inner.aclose()


REFUSAL = {"code": "overloaded", "detail": "busy (the test's proxy)", "status": 503}


class Flaky(httpx.BaseTransport):
    """Forwards to the API, except: the first ``POST /tasks`` is answered 503 with
    ``Retry-After: 0``, and the first event stream is cut after ``cut_after`` events."""

    def __init__(self, cut_after: int = 0) -> None:
        self.real = httpx.HTTPTransport()
        self.cut_after = cut_after
        self.requests: list[httpx.Request] = []

    def handle_request(self, request: httpx.Request) -> httpx.Response:
        self.requests.append(request)
        if refused(self.requests, request):
            return httpx.Response(503, headers={"Retry-After": "0"}, json=REFUSAL)
        answer = self.real.handle_request(request)
        if self.cut_after and first_stream(self.requests, request):
            assert isinstance(answer.stream, httpx.SyncByteStream)
            cut = CutStream(answer.stream, self.cut_after)
            return httpx.Response(answer.status_code, headers=answer.headers, stream=cut)
        return answer

    def close(self) -> None:
        self.real.close()


class AsyncFlaky(httpx.AsyncBaseTransport):
    def __init__(self, cut_after: int = 0) -> None:
        self.real = httpx.AsyncHTTPTransport()
        self.cut_after = cut_after
        self.requests: list[httpx.Request] = []

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        self.requests.append(request)
        if refused(self.requests, request):
            return httpx.Response(503, headers={"Retry-After": "0"}, json=REFUSAL)
        answer = await self.real.handle_async_request(request)
        if self.cut_after and first_stream(self.requests, request):
            assert isinstance(answer.stream, httpx.AsyncByteStream)
            cut = AsyncCutStream(answer.stream, self.cut_after)
            return httpx.Response(answer.status_code, headers=answer.headers, stream=cut)
        return answer

    async def aclose(self) -> None:
        await self.real.aclose()


def submits(requests: list[httpx.Request]) -> list[httpx.Request]:
    return [r for r in requests if r.method == "POST" and r.url.path == "/tasks"]


def refused(requests: list[httpx.Request], request: httpx.Request) -> bool:
    return submits(requests) == [request]


def streams(requests: list[httpx.Request]) -> list[httpx.Request]:
    return [r for r in requests if r.url.path.endswith("/events")]


def first_stream(requests: list[httpx.Request], request: httpx.Request) -> bool:
    return streams(requests) == [request]


def assert_whole_stream(events: list[Event], transport_requests: list[httpx.Request]) -> None:
    ids = [e.id for e in events]
    assert ids == list(range(1, len(ids) + 1)), f"a gap or a duplicate: {ids}"
    assert events[-1].final and events[-1].type == "succeeded"
    assert [e.data["index"] for e in events if e.type == "output"] == [1, 2, 3, 4]
    opened = streams(transport_requests)
    assert len(opened) == 2, "the cut stream was opened again once"
    assert "last-event-id" not in opened[0].headers
    assert opened[1].headers["last-event-id"] == "3"


# -- the blocking client ----------------------------------------------------------------------


def test_run_submits_in_sync_mode_and_returns_the_finished_task(account: tuple[str, str]) -> None:
    with Reach(*account) as reach:
        task = reach.run("echo", {"a": 1}, timeout=30)
        assert (task.status, task.result) == ("succeeded", {"a": 1})
        assert reach.tasks.get(task.task_id) == task
        assert task.raise_for_status() is task


def test_submit_then_wait_polls_until_final(account: tuple[str, str]) -> None:
    with Reach(*account) as reach:
        task = reach.tasks.submit("test.sleepy", {"sleep_s": 0.5}, metadata={"n": "1"})
        assert task.status in ("queued", "running") and task.metadata == {"n": "1"}
        done = reach.tasks.wait(task.task_id, timeout=30)
    assert done.status == "succeeded" and done.task_id == task.task_id


def test_a_wait_that_runs_out_says_so_with_the_task(account: tuple[str, str]) -> None:
    with Reach(*account) as reach:
        with pytest.raises(WaitTimeoutError) as caught:
            reach.run("test.sleepy", {"sleep_s": 5}, timeout=0.5)
        assert caught.value.task.status in ("queued", "running")
        assert reach.tasks.cancel(caught.value.task.task_id).status == "cancelled"


def test_the_stream_resumes_after_a_cut_with_no_gap_and_no_duplicate(
    account: tuple[str, str],
) -> None:
    transport = Flaky(cut_after=3)
    with httpx.Client(transport=transport) as http, Reach(*account, http_client=http) as reach:
        task = reach.tasks.submit("text.summarize", STREAMED)
        events = list(reach.tasks.stream(task.task_id))
    assert_whole_stream(events, transport.requests)
    final = events[-1].task
    assert final is not None and final.result["sentences"]


def test_a_stream_outlives_an_api_restart(
    settings: Settings, tenant: tuple[str, str], worker: CeleryProcess
) -> None:
    """A deploy takes an API away for seconds; the stream's retries alone lasted 1.5 s."""
    events: list[Event] = []
    first = threading.Event()
    port = free_port()

    def follow(reach: Reach, task_id: str) -> None:
        for event in reach.tasks.stream(task_id):
            events.append(event)
            first.set()

    with ServedApp(create_app(settings), port=port) as before:
        reach = Reach(before.url, tenant[1])
        slow = {"text": SUMMARY_TEXT, "max_sentences": 4, "delay_s": 1.5}
        task = reach.tasks.submit("text.summarize", slow)
        following = threading.Thread(target=follow, args=(reach, task.task_id))
        following.start()
        assert first.wait(30), "no event came"
    # When the API is away for 3 s (its stop ends the stream), then back on its port
    time.sleep(3)
    try:
        with ServedApp(create_app(settings), port=port):
            following.join(60)
    finally:
        reach.close()
    # Then the stream went on where it stopped, to its final event
    assert not following.is_alive()
    assert [e.id for e in events] == list(range(1, len(events) + 1))
    assert events[-1].final and events[-1].type == "succeeded"
    assert sum(e.type == "output" for e in events) == 4


def test_a_client_holds_its_max_connections_and_says_so_when_all_are_held(
    account: tuple[str, str],
) -> None:
    """Each open stream holds a connection; httpx's pool of 100 was the async client's
    unsaid ceiling (200 of 300 streams waited, then failed 'no answer in time: ')."""
    slow = {"text": SUMMARY_TEXT, "max_sentences": 3, "delay_s": 1.0}

    async def scenario() -> str:
        timeout = httpx.Timeout(30, pool=0.5)
        async with AsyncReach(*account, max_connections=2, timeout=timeout) as reach:
            tasks = [await reach.tasks.submit("text.summarize", slow) for _ in range(2)]
            streams = [reach.tasks.stream(t.task_id) for t in tasks]
            for stream in streams:  # both open: each holds a connection
                await anext(stream)
            try:
                await reach.tasks.get(tasks[0].task_id)
            except APITimeoutError as exc:
                return str(exc)
            finally:
                for stream in streams:
                    await stream.aclose()
            return "answered"

    assert "no free connection in the client's pool" in asyncio.run(scenario())


def test_list_pages_through_every_task(account: tuple[str, str]) -> None:
    pages: list[httpx.Request] = []
    hooks = {"request": [lambda r: pages.append(r) if r.url.path == "/tasks" else None]}
    with httpx.Client(event_hooks=hooks) as http, Reach(*account, http_client=http) as reach:
        submitted = [reach.tasks.submit("echo", {"i": i}).task_id for i in range(5)]
        pages.clear()
        listed = [t.task_id for t in reach.tasks.list(capability="echo", limit=2)]
    assert listed == submitted[::-1]  # newest first, each once
    assert len(pages) == 3 and "cursor" in str(pages[-1].url)


def test_sessions_are_listed_and_a_sessions_tasks_are_only_its_own(
    account: tuple[str, str],
) -> None:
    with Reach(*account) as reach:
        made = [reach.sessions.create({"n": i}).session_id for i in range(3)]
        assert [s.session_id for s in reach.sessions.list(limit=2)] == made[::-1]
        page = reach.sessions.list_page(limit=2)
        assert [s.session_id for s in page.items] == made[:0:-1] and page.next_cursor
        mine = reach.tasks.submit("echo", {"n": 1}, session_id=made[0])
        reach.tasks.submit("echo", {"n": 2})
        listed = [t.task_id for t in reach.tasks.list(session_id=made[0])]
        assert listed == [mine.task_id]
        assert reach.tasks.list_page(session_id=made[1]).items == []


def test_the_async_client_lists_sessions_and_a_sessions_tasks(account: tuple[str, str]) -> None:
    async def scenario() -> tuple[list[str], list[str], str, str]:
        async with AsyncReach(*account) as reach:
            session = await reach.sessions.create()
            task = await reach.tasks.submit("echo", {}, session_id=session.session_id)
            sessions = [s.session_id async for s in reach.sessions.list()]
            listed = [t.task_id async for t in reach.tasks.list(session_id=session.session_id)]
        return sessions, listed, session.session_id, task.task_id

    sessions, listed, session_id, task_id = asyncio.run(scenario())
    assert sessions == [session_id]
    assert listed == [task_id]


def test_cancel_ends_a_running_task_and_a_second_cancel_conflicts(
    account: tuple[str, str],
) -> None:
    with Reach(*account) as reach:
        task = reach.tasks.submit("test.sleepy", {"sleep_s": 20})
        assert reach.tasks.cancel(task.task_id).status == "cancelled"
        assert reach.tasks.wait(task.task_id, timeout=30).status == "cancelled"
        with pytest.raises(ConflictError) as caught:
            reach.tasks.cancel(task.task_id)
    assert caught.value.code == "task_final" and caught.value.trace_id


def test_a_503_is_retried_with_the_same_idempotency_key(
    account: tuple[str, str], tenant: tuple[str, str], engine: Engine
) -> None:
    transport = Flaky()
    with httpx.Client(transport=transport) as http, Reach(*account, http_client=http) as reach:
        task = reach.tasks.submit("echo", {"once": True})
    tried = submits(transport.requests)
    assert len(tried) == 2
    assert tried[0].headers["idempotency-key"] == tried[1].headers["idempotency-key"]
    assert count_tasks(engine, tenant[0]) == 1
    assert task.capability == "echo"


def test_errors_are_typed_and_carry_the_trace_id(account: tuple[str, str]) -> None:
    url, key = account
    with Reach(url, "rk_not-a-key") as stranger, pytest.raises(AuthenticationError) as denied:
        stranger.tasks.get("0193")
    assert denied.value.status == 401 and denied.value.trace_id
    with Reach(url, key) as reach:
        with pytest.raises(NotFoundError) as missing:
            reach.tasks.get("00000000-0000-0000-0000-000000000000")
        assert missing.value.code == "task_not_found"
        session = reach.sessions.create({"cart": ["tea"]})
        reach.sessions.update(session.session_id, {"cart": ["tea", "milk"]}, revision=1)
        with pytest.raises(RevisionConflictError) as stale:
            reach.sessions.update(session.session_id, {"cart": []}, revision=1)
    assert stale.value.current_revision == 2


def test_sessions_webhooks_agents_and_capabilities(account: tuple[str, str]) -> None:
    with Reach(*account) as reach:
        session = reach.sessions.create({"cart": ["tea"]}, ttl_s=600)
        patched = reach.sessions.patch(
            session.session_id, {"state": {"cart": None, "step": 2}}, revision=1
        )
        assert (patched.revision, patched.state) == (2, {"step": 2})
        assert [r.revision for r in reach.sessions.revisions(session.session_id)] == [2, 1]
        reach.sessions.delete(session.session_id)
        with pytest.raises(NotFoundError):
            reach.sessions.get(session.session_id)

        hook = reach.webhooks.create("http://127.0.0.1:9/hook", events=["task.failed"])
        assert hook.secret and hook.secret.startswith("whsec_")
        assert [h.webhook_id for h in reach.webhooks.list()] == [hook.webhook_id]
        assert reach.webhooks.get(hook.webhook_id).secret is None
        assert list(reach.webhooks.deliveries(hook.webhook_id)) == []
        reach.webhooks.delete(hook.webhook_id)

        assert "echo" in {c for a in reach.agents.list() for c in a.capabilities}
        assert reach.agents.get("echo").live_instances >= 1
        echo = next(c for c in reach.capabilities.list() if c.capability == "echo")
        assert echo.live_instances >= 1


# -- the asyncio client: the same surface ----------------------------------------------------


def test_the_async_client_submits_waits_streams_pages_cancels_and_retries(
    account: tuple[str, str], tenant: tuple[str, str], engine: Engine
) -> None:
    async def scenario() -> None:
        transport = AsyncFlaky(cut_after=3)
        async with (
            httpx.AsyncClient(transport=transport) as http,
            AsyncReach(*account, http_client=http) as reach,
        ):
            first = await reach.tasks.submit("text.summarize", STREAMED)  # refused once
            events = [e async for e in reach.tasks.stream(first.task_id)]
            assert_whole_stream(events, transport.requests)
            tried = submits(transport.requests)
            assert tried[0].headers["idempotency-key"] == tried[1].headers["idempotency-key"]

            done = await reach.run("echo", {"a": 2}, timeout=30)
            assert (done.status, done.result) == ("succeeded", {"a": 2})
            sleepy = await reach.tasks.submit("test.sleepy", {"sleep_s": 20})
            assert (await reach.tasks.cancel(sleepy.task_id)).status == "cancelled"
            assert (await reach.tasks.wait(sleepy.task_id, timeout=30)).status == "cancelled"
            listed = [t.task_id async for t in reach.tasks.list(limit=1)]
            assert listed == [sleepy.task_id, done.task_id, first.task_id]

    asyncio.run(scenario())
    assert count_tasks(engine, tenant[0]) == 3


def test_an_async_client_kept_across_event_loops_works_on_each(account: tuple[str, str]) -> None:
    # Given an AsyncReach kept at module level, as a script or a test suite keeps one
    reach = AsyncReach(*account)

    async def once() -> Task:
        return await reach.run("echo", {"a": 1}, timeout=30)

    # When it is used from one asyncio.run, then from another (the first loop closed)
    first = asyncio.run(once())
    second = asyncio.run(once())
    # Then each call runs its task, on connections of its own loop
    assert (first.status, second.status) == ("succeeded", "succeeded")
    assert first.task_id != second.task_id
    asyncio.run(reach.close())


def test_a_callers_async_http_client_used_on_another_loop_is_a_configuration_error(
    account: tuple[str, str],
) -> None:
    # Given an AsyncReach on the caller's own httpx.AsyncClient, used on one loop
    http = httpx.AsyncClient()
    reach = AsyncReach(*account, http_client=http)
    assert asyncio.run(reach.run("echo", {}, timeout=30)).status == "succeeded"
    # When another loop uses it, it says so (the caller's pool cannot serve there), typed
    with pytest.raises(ConfigurationError, match="another event loop"):
        asyncio.run(reach.run("echo", {}, timeout=30))
