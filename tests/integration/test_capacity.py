"""One tenant cannot take the API's capacity from the others: slow bodies, sync-wait floods,
host names that never resolve and random API keys each cost their sender only.

Given a stack on a Redis db of its own (no live agent: tasks wait in the queue) and two
tenants, when one of them behaves like an attacker, I expect the other still to be served.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import secrets
import socket
import threading
import time
import uuid
from collections import Counter
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx
import pytest
import redis
from sqlalchemy import Engine, event, text

from api import services
from api.app import create_app
from api.connections import SEND_BUFFER_BYTES
from broker.observability import metrics
from broker.settings import Settings
from broker.tasks.events import OUTPUT, EventLog, channel
from broker.webhooks.ssrf import HostLookups
from tests.eventually import eventually
from tests.integration.activity import at_once
from tests.integration.conftest import KeyMaker, client_for, count_tasks
from tests.integration.rows import a_task_row
from tests.integration.stack import CeleryProcess, ServedApp
from tests.integration.test_grouping import live_echo_lease

QUEUED_ECHO = {"capability": "echo", "payload": {}, "queue_if_unavailable": True}


@pytest.fixture
def stack_for(
    settings: Settings, own_redis: str, worker: CeleryProcess
) -> Iterator[Callable[..., ServedApp]]:
    """An API on its own Redis db with the given settings. The session worker has advertised
    ``echo``'s card; nobody serves it on this db, so its tasks wait in the queue."""
    served: list[ServedApp] = []

    def start(app_hook: Callable[[Any], None] | None = None, **update: Any) -> ServedApp:
        app = create_app(settings.model_copy(update={"redis_url": own_redis, **update}))
        if app_hook is not None:
            app_hook(app)
        served.append(ServedApp(app).__enter__())
        return served[-1]

    yield start
    for each in served:
        each.__exit__(None, None, None)


async def _slow_bodies(port: int, token: str, count: int) -> list[asyncio.StreamWriter]:
    """``count`` submits whose headers promise a body of which only a byte ever comes."""
    writers = []
    for _ in range(count):
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(
            b"POST /tasks HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            + f"Authorization: Bearer {token}\r\nContent-Length: 1000\r\n\r\n{{".encode()
        )
        writer.reader = reader  # type: ignore[attr-defined]
        writers.append(writer)
    await asyncio.gather(*(w.drain() for w in writers))
    return writers


async def _answered(writers: list[asyncio.StreamWriter], within_s: float) -> dict[int, int]:
    """How many connections got an answer within ``within_s``, by status; -1: none yet."""
    reads = [asyncio.ensure_future(w.reader.read(64)) for w in writers]  # type: ignore[attr-defined]
    done, pending = await asyncio.wait(reads, timeout=within_s)
    counts: dict[int, int] = {}
    for read in reads:
        head = read.result() if read in done else b""
        status = int(head.split(b" ")[1]) if head.startswith(b"HTTP/1.1 ") else -1
        counts[status] = counts.get(status, 0) + 1
    for read in pending:
        read.cancel()
    return counts


async def _until_refused(http: httpx.AsyncClient, body: dict[str, Any]) -> int:
    """Submits until one is refused (its share is taken); the status it was refused with."""
    for _ in range(2000):
        answer = await http.post("/tasks", json=body)
        if answer.status_code in (429, 503):
            return answer.status_code
    raise AssertionError("the tenant was never refused")


def test_one_tenants_slow_bodies_and_sync_waits_leave_another_tenant_served(
    stack_for: Callable[..., ServedApp], make_key: KeyMaker
) -> None:
    """Issue 12 item 6, with the defaults: 1,100 slow-body connections plus a sync-wait flood
    from one tenant; the other tenant's submits all get 202."""
    api = stack_for(sync_max_wait_s=5, body_read_timeout_s=60)
    _, attacker = make_key()
    _, victim = make_key()

    async def scenario() -> tuple[dict[int, int], int, list[int]]:
        writers = await _slow_bodies(api.port, attacker, 1100)
        headers = {"Authorization": f"Bearer {attacker}"}
        async with httpx.AsyncClient(base_url=api.url, headers=headers, timeout=30) as http:
            flood = [
                asyncio.ensure_future(
                    http.post("/tasks", json={**QUEUED_ECHO, "reply_mode": "sync"})
                )
                for _ in range(300)
            ]
            refused_with = await _until_refused(http, QUEUED_ECHO)
            headers = {"Authorization": f"Bearer {victim}"}
            async with httpx.AsyncClient(base_url=api.url, headers=headers, timeout=30) as other:
                seen = [
                    (await other.post("/tasks", json=QUEUED_ECHO)).status_code for _ in range(30)
                ]
            answered = await _answered(writers, within_s=1)
            for writer in writers:
                writer.close()
            await asyncio.gather(*flood, return_exceptions=True)
        return answered, refused_with, seen

    answered, refused_with, seen = asyncio.run(scenario())
    print(f"attacker's 1,100 slow bodies, answered at once by status: {answered}")
    print(f"attacker refused with {refused_with}; the other tenant saw {seen}")
    assert seen == [202] * 30
    assert refused_with in (429, 503)
    assert answered.get(-1, 0) + answered.get(429, 0) + answered.get(503, 0) == 1100


def test_one_tenant_holds_at_most_its_share_of_the_waiting_requests(
    stack_for: Callable[..., ServedApp], make_key: KeyMaker
) -> None:
    """With the rate limit out of the way, the waiting cap itself is shared: 70 slow bodies of
    one tenant against a cap of 64 (16 a tenant) leave room for the other tenant."""
    api = stack_for(
        max_requests_waiting=64,
        max_requests_waiting_per_tenant=16,
        rate_limit_per_s=10_000,
        rate_limit_burst=10_000,
    )
    _, attacker = make_key()
    _, victim = make_key()
    with httpx.Client(base_url=api.url, headers={"Authorization": f"Bearer {attacker}"}) as http:
        assert http.post("/tasks", json=QUEUED_ECHO).status_code == 202  # its key is known

    async def scenario() -> tuple[dict[int, int], list[int]]:
        writers = await _slow_bodies(api.port, attacker, 70)
        answered = await _answered(writers, within_s=2)
        headers = {"Authorization": f"Bearer {victim}"}
        async with httpx.AsyncClient(base_url=api.url, headers=headers, timeout=30) as other:
            seen = [(await other.post("/tasks", json=QUEUED_ECHO)).status_code for _ in range(10)]
        for writer in writers:
            writer.close()
        return answered, seen

    answered, seen = asyncio.run(scenario())
    assert answered == {-1: 16, 503: 54}
    assert seen == [202] * 10


def _waiting_request(door: str, token: str) -> bytes:
    """A request of ``door`` that waits for its task (``QUEUED_ECHO``, which nobody runs)."""
    if door == "rest":
        path, document = "/tasks", {**QUEUED_ECHO, "reply_mode": "sync"}
    elif door == "a2a":
        message = {
            "messageId": str(uuid.uuid4()),
            "role": "ROLE_USER",
            "parts": [{"data": {}}],
            "metadata": {"capability": "echo", "queue_if_unavailable": True},
        }
        path = "/a2a/jsonrpc"
        document = {
            "jsonrpc": "2.0",
            "id": 1,
            "method": "SendMessage",
            "params": {"message": message},
        }
    else:
        path = "/mcp"
        call = {"name": "echo", "arguments": {}}
        document = {"jsonrpc": "2.0", "id": 1, "method": "tools/call", "params": call}
    body = json.dumps(document).encode()
    head = (
        f"POST {path} HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {token}\r\n"
        "A2A-Version: 1.0\r\nAccept: application/json, text/event-stream\r\n"
        f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n"
    )
    return head.encode() + body


@pytest.mark.parametrize("door", ["rest", "a2a", "mcp"])
def test_a_wait_whose_client_left_gives_its_place_back(
    stack_for: Callable[..., ServedApp],
    make_key: KeyMaker,
    engine: Engine,
    own_redis: str,
    door: str,
) -> None:
    """A sync submit whose caller gave up (a timeout of its own) held its place among the
    requests waiting until its wait ended, up to ``REACH_SYNC_MAX_WAIT_S``: a tenant whose
    callers gave up on 256 of them had every request refused 503 meanwhile. So did an A2A
    blocking message and an MCP call."""
    # Given a tenant that may have 3 requests waiting, with waits of up to 5 minutes
    api = stack_for(
        max_requests_waiting_per_tenant=3,
        sync_max_wait_s=300,
        mcp_wait_s=300,
        rate_limit_per_s=10_000,
        rate_limit_burst=10_000,
    )
    live_echo_lease(own_redis)  # an MCP call runs only what a live agent serves
    tenant, token = make_key()
    with client_for(api, token) as http:
        assert http.get("/tasks").status_code == 200  # its key is known

        # When 3 waits for tasks nobody runs begin, and their clients leave
        async def give_up() -> None:
            writers = []
            for _ in range(3):
                _, writer = await asyncio.open_connection("127.0.0.1", api.port)
                writer.write(_waiting_request(door, token))
                writers.append(writer)
            await asyncio.to_thread(
                eventually, lambda: count_tasks(engine, tenant) == 3, "the 3 tasks accepted"
            )
            for writer in writers:
                writer.transport.abort()

        asyncio.run(give_up())

        # Then the tenant's requests are answered again, long before those waits would end
        eventually(lambda: http.get("/tasks").status_code == 200, "a request answered")


async def _opened(
    http: httpx.AsyncClient, method: str, url: str, **kwargs: Any
) -> tuple[int, httpx.Headers, bytes]:
    """A request's status and headers, and its body unless it is a stream (which is closed)."""
    async with http.stream(method, url, **kwargs) as answer:
        body = b"" if answer.status_code == 200 else await answer.aread()
        return answer.status_code, answer.headers, body


def test_one_tenant_holds_at_most_its_streams_and_another_still_opens_its_own(
    stack_for: Callable[..., ServedApp], make_key: KeyMaker, engine: Engine
) -> None:
    """Each SSE stream holds a connection and memory for as long as it is open: one tenant's
    thousands would take the process's file descriptors from everyone. Past its streams, a
    tenant is refused 429 at once, a stream-mode submit with nothing written."""
    api = stack_for(max_streams_per_tenant=5, rate_limit_per_s=10_000, rate_limit_burst=10_000)
    attacker_tenant, attacker = make_key()
    _, victim = make_key()

    def tasks_of(tenant: str) -> int:
        with engine.connect() as conn:
            return int(
                conn.execute(
                    text("SELECT count(*) FROM tasks WHERE tenant = :t"), {"t": tenant}
                ).scalar_one()
            )

    async def scenario() -> None:
        mine = {"Authorization": f"Bearer {attacker}"}
        theirs = {"Authorization": f"Bearer {victim}"}
        async with (
            httpx.AsyncClient(base_url=api.url, headers=mine, timeout=30) as http,
            httpx.AsyncClient(base_url=api.url, headers=theirs, timeout=30) as other,
            contextlib.AsyncExitStack() as held,
        ):
            task_id = (await http.post("/tasks", json=QUEUED_ECHO)).json()["task_id"]
            # Given the attacker holds 5 streams of its queued task open
            for _ in range(5):
                stream = await held.enter_async_context(
                    http.stream("GET", f"/tasks/{task_id}/events")
                )
                assert stream.status_code == 200
            # When it opens a sixth, or submits in stream mode
            refused = await _opened(http, "GET", f"/tasks/{task_id}/events")
            written_before = await asyncio.to_thread(tasks_of, attacker_tenant)
            submitted = await _opened(
                http, "POST", "/tasks", json={**QUEUED_ECHO, "reply_mode": "stream"}
            )
            # Then both are 429 too_many_streams, and the submit wrote no task
            for status, headers, body in (refused, submitted):
                assert status == 429, body
                assert headers["content-type"] == "application/problem+json"
                assert json.loads(body)["code"] == "too_many_streams"
                assert headers["retry-after"] == "1"
            assert await asyncio.to_thread(tasks_of, attacker_tenant) == written_before
            # And the other tenant opens its streams as ever
            async with other.stream(
                "POST", "/tasks", json={**QUEUED_ECHO, "reply_mode": "stream"}
            ) as theirs_open:
                assert theirs_open.status_code == 200
                assert theirs_open.headers["content-type"].startswith("text/event-stream")
            # And once the attacker closes its streams, it opens one again
            await held.aclose()

            async def opens() -> int:
                async with http.stream("GET", f"/tasks/{task_id}/events") as again:
                    return again.status_code

            for _ in range(100):
                if (status := await opens()) == 200:
                    break
                await asyncio.sleep(0.05)
            assert status == 200

    asyncio.run(scenario())


def test_a_body_that_does_not_arrive_in_time_is_answered_408(
    stack_for: Callable[..., ServedApp], make_key: KeyMaker
) -> None:
    api = stack_for(body_read_timeout_s=0.5)
    _, token = make_key()

    async def scenario() -> bytes:
        (writer,) = await _slow_bodies(api.port, token, 1)
        answer: bytes = await asyncio.wait_for(writer.reader.read(4096), 30)  # type: ignore[attr-defined]
        writer.close()
        return answer

    answer = asyncio.run(scenario())
    assert answer.startswith(b"HTTP/1.1 408 ")
    assert b'"code":"body_timeout"' in answer.replace(b" ", b"")


def test_the_rate_is_taken_before_the_body_is_read(
    stack_for: Callable[..., ServedApp], make_key: KeyMaker
) -> None:
    """A tenant with no token left is refused at once, whatever its body does."""
    api = stack_for(rate_limit_per_s=0.001, rate_limit_burst=1, body_read_timeout_s=30)
    _, token = make_key()
    with httpx.Client(base_url=api.url, headers={"Authorization": f"Bearer {token}"}) as http:
        assert http.post("/tasks", json=QUEUED_ECHO).status_code == 202

    async def scenario() -> dict[int, int]:
        writers = await _slow_bodies(api.port, token, 5)
        answered = await _answered(writers, within_s=10)
        for writer in writers:
            writer.close()
        return answered

    assert asyncio.run(scenario()) == {429: 5}


class NeverAnswers:
    """A resolver standing in for a name server that never answers (``tarpit.example``); any
    other name resolves to a public address."""

    def __init__(self) -> None:
        self.release = threading.Event()
        self.calls = 0

    def __call__(self, host: str, port: int) -> list[str]:
        self.calls += 1
        if host == "tarpit.example":
            self.release.wait(60)
        return ["93.184.216.34"]


def test_host_names_that_never_resolve_hold_only_their_tenants_lookups(
    stack_for: Callable[..., ServedApp], make_key: KeyMaker
) -> None:
    resolver = NeverAnswers()

    def bounded(app: Any) -> None:
        app.state.services.lookups = HostLookups(
            threads=4, timeout_s=0.5, per_tenant=2, resolver=resolver
        )

    api = stack_for(app_hook=bounded)
    _, attacker = make_key()
    _, victim = make_key()
    tarpit = {"url": "https://tarpit.example/hook"}
    try:
        with httpx.Client(
            base_url=api.url, headers={"Authorization": f"Bearer {attacker}"}, timeout=30
        ) as http:
            first = [http.post("/webhooks", json=tarpit) for _ in range(2)]
            third = http.post("/webhooks", json=tarpit)
        with httpx.Client(
            base_url=api.url, headers={"Authorization": f"Bearer {victim}"}, timeout=30
        ) as other:
            created = [
                other.post("/webhooks", json={"url": f"https://ok.example/{n}"}) for n in range(3)
            ]
    finally:
        resolver.release.set()
    assert [a.status_code for a in first] == [422, 422]
    assert all("did not resolve within" in a.json()["detail"] for a in first)
    assert (third.status_code, third.json()["code"]) == (429, "rate_limited")
    assert resolver.calls == 2 + 3  # the third was refused without a lookup
    assert [a.status_code for a in created] == [201, 201, 201]


def test_webhook_registration_takes_a_token(
    stack_for: Callable[..., ServedApp], make_key: KeyMaker
) -> None:
    api = stack_for(rate_limit_per_s=0.001, rate_limit_burst=2, webhook_allow=["127.0.0.1"])
    _, token = make_key()
    with httpx.Client(base_url=api.url, headers={"Authorization": f"Bearer {token}"}) as http:
        answers = [
            http.post("/webhooks", json={"url": f"http://127.0.0.1:9/{n}"}) for n in range(3)
        ]
    assert [a.status_code for a in answers] == [201, 201, 429]
    assert answers[2].json()["code"] == "rate_limited"


def test_a_capabilitys_series_takes_a_token_and_its_list_does_not(
    stack_for: Callable[..., ServedApp], make_key: KeyMaker
) -> None:
    api = stack_for(rate_limit_per_s=0.001, rate_limit_burst=2)
    _, token = make_key()
    with httpx.Client(base_url=api.url, headers={"Authorization": f"Bearer {token}"}) as http:
        series = [http.get("/capabilities/echo/series") for _ in range(3)]
        listed = http.get("/capabilities")
    assert [a.status_code for a in series] == [200, 200, 429]
    assert series[2].json()["code"] == "rate_limited"
    assert listed.status_code == 200


def test_unknown_keys_cost_a_bounded_number_of_queries(
    stack_for: Callable[..., ServedApp], make_key: KeyMaker
) -> None:
    statements: list[str] = []

    def counted(app: Any) -> None:
        def record(conn: Any, cursor: Any, statement: str, *args: Any) -> None:
            if "api_keys" in statement:
                statements.append(statement)

        event.listen(app.state.services.engine.sync_engine, "before_cursor_execute", record)

    rate_per_s = 5.0  # a burst of twice that (api.callers.Budget)
    api = stack_for(app_hook=counted, auth_lookups_per_s=rate_per_s, key_cache_s=60)
    _, valid = make_key()
    with httpx.Client(base_url=api.url) as http:
        assert http.get("/tasks", headers={"Authorization": f"Bearer {valid}"}).status_code == 200
        before = len(statements)
        # The address's lookup budget is full until its first unknown key, below
        started = time.monotonic()
        one_unknown = f"rk_{secrets.token_hex(6)}_{secrets.token_urlsafe(8)}"
        same = [
            http.get("/tasks", headers={"Authorization": f"Bearer {one_unknown}"}).status_code
            for _ in range(20)
        ]
        assert len(statements) - before == 1  # a missing key is remembered as missing
        random = [
            http.get(
                "/tasks",
                headers={"Authorization": f"Bearer rk_{secrets.token_hex(6)}_{'x' * 20}"},
            ).status_code
            for _ in range(200)
        ]
        looked_up = len(statements) - before
        elapsed_s = time.monotonic() - started
        known = http.get("/tasks", headers={"Authorization": f"Bearer {valid}"}).status_code
    print(
        f"200 random key ids: {looked_up} key queries in {elapsed_s:.2f} s,"
        f" answers {sorted(set(random))}"
    )
    assert set(same) == {401}
    assert set(random) == {401, 429}
    # At most the burst, plus the rate over the time the run took (however long that was)
    assert looked_up <= 2 * rate_per_s + rate_per_s * elapsed_s, (looked_up, elapsed_s)
    assert known == 200  # a key verified before is still served from memory


def test_one_tenants_read_flood_is_refused_at_its_request_rate_and_another_still_reads(
    stack_for: Callable[..., ServedApp], make_key: KeyMaker
) -> None:
    """Reads take no task token; before the request rate, a tenant's flood of cheap reads
    from many connections took the process from every other tenant. Past its burst, its
    requests are 429 before any query; another tenant's are answered."""
    lookups: list[str] = []

    def counted(app: Any) -> None:
        def record(conn: Any, cursor: Any, statement: str, *args: Any) -> None:
            if "page_candidates" in statement:  # a page of GET /tasks
                lookups.append(statement)

        event.listen(app.state.services.engine.sync_engine, "before_cursor_execute", record)

    rate_per_s = 5.0  # a burst of twice that (api.callers.Budget)
    api = stack_for(app_hook=counted, request_rate_per_s=rate_per_s)
    _, hog = make_key()
    _, other = make_key()
    with httpx.Client(base_url=api.url) as http:
        started = time.monotonic()
        answers = [
            http.get("/tasks", headers={"Authorization": f"Bearer {hog}"}) for _ in range(40)
        ]
        elapsed_s = time.monotonic() - started
        read_by_hog = len(lookups)
        others = http.get("/tasks", headers={"Authorization": f"Bearer {other}"})
    statuses = [a.status_code for a in answers]
    served = statuses.count(200)
    print(f"40 reads in {elapsed_s:.2f} s: {served} answered, {statuses.count(429)} refused")
    assert set(statuses) == {200, 429}
    # The burst, plus the rate over the time the run took (however long that was)
    assert 2 * rate_per_s <= served <= 2 * rate_per_s + rate_per_s * elapsed_s + 1
    assert read_by_hog == served  # a refused read made no query
    refused = answers[statuses.index(429)]
    assert refused.json()["code"] == "rate_limited"
    assert int(refused.headers["retry-after"]) >= 1
    assert others.status_code == 200


def test_a_stream_nobody_reads_holds_a_bounded_kernel_send_buffer(
    api: ServedApp, engine: Engine, make_key: KeyMaker, settings: Settings
) -> None:
    """Left to autotuning, the kernel held up to 4 MiB (``net.ipv4.tcp_wmem``) for each
    connection whose client stopped reading: 1,000 of one tenant's streams, 3.7 GB of the
    API process's memory. ``api.connections.Protocol`` bounds each connection's buffer."""
    # Given a task whose log holds about 4 MB of output
    tenant, token = make_key()
    task_id = a_task_row(engine, tenant=tenant, status="running")
    log = EventLog(redis.Redis.from_url(settings.redis_url), 600, settings.event_log_max_bytes)
    for n in range(100):
        log.append(task_id, OUTPUT, f"{n:03d}" + "x" * 40_000, tenant="t", trace_id="t")
    # When a client with a small receive window opens its stream and reads nothing
    with socket.socket() as reader:
        reader.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 64 * 1024)
        reader.connect(("127.0.0.1", api.port))
        reader.sendall(
            f"GET /tasks/{task_id}/events HTTP/1.1\r\nHost: x\r\n"
            f"Authorization: Bearer {token}\r\n\r\n".encode()
        )
        held = _settled_send_queue(api.port, reader.getsockname()[1])
    # Then the API's socket holds what its bound allows, not megabytes
    print(f"the API's send queue for a stream nobody reads: {held // 1024} KiB")
    assert 64 * 1024 < held <= 2 * SEND_BUFFER_BYTES


BIG_RESULT = "x" * (1024 * 1024)


def _finished_with_a_big_result(engine: Engine, tenant: str) -> Any:
    task_id = a_task_row(engine, tenant=tenant, status="running")
    with engine.begin() as conn:
        conn.execute(
            text(
                "UPDATE tasks SET status = 'succeeded', result = to_jsonb(CAST(:r AS text)),"
                " finished_at = now() WHERE id = :id"
            ),
            {"r": BIG_RESULT, "id": task_id},
        )
    return task_id


def _asked_for(port: int, path: str, token: str, window: int = 4096) -> socket.socket:
    """A connection that has sent one GET, with a receive buffer of ``window`` bytes."""
    request = f"GET {path} HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {token}\r\n\r\n"
    return _sent(port, request, window)


def _sent(port: int, request: str, window: int = 4096) -> socket.socket:
    reader = socket.socket()
    reader.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, window)
    reader.connect(("127.0.0.1", port))
    reader.sendall(request.encode())
    return reader


@pytest.mark.parametrize("answer", ["a task with a 1 MiB result", "its event stream"])
def test_a_client_that_stops_reading_loses_its_connection_and_what_waited_for_it(
    stack_for: Callable[..., ServedApp],
    engine: Engine,
    make_key: KeyMaker,
    settings: Settings,
    answer: str,
) -> None:
    """Past the kernel's buffer an answer waits in the API process, and uvicorn closes a
    connection by flushing it first: a client whose window stays shut held the answer and a
    file descriptor for as long as it liked, outside every slot a tenant has (a plain answer
    holds none once it has started; a stream gives its slot back at the send timeout and kept
    its connection). ``REACH_CLIENT_STALL_S`` ends it."""
    # Given a task with about 1 MiB to answer, and a client that asks for it and reads nothing
    api = stack_for(client_stall_s=0.5, sse_send_timeout_s=0.5)
    tenant, token = make_key()
    task_id = _finished_with_a_big_result(engine, tenant)
    path = f"/tasks/{task_id}" + ("/events" if "stream" in answer else "")
    with contextlib.closing(_asked_for(api.port, path, token)) as reader:
        client_port = reader.getsockname()[1]
        # When bytes have been waiting for it for a while
        eventually(
            lambda: _server_side(api.port, client_port) == "waiting",
            "the answer to fill the connection",
        )
        # Then the API has dropped its side of the connection
        eventually(
            lambda: _server_side(api.port, client_port) == "gone",
            "the API to drop the connection",
            timeout_s=20,
        )
        assert _server_side(api.port, client_port) == "gone"
        with pytest.raises(ConnectionResetError):  # a reset, not an answer that ended
            while reader.recv(65536):
                pass


def test_an_a2a_subscription_nobody_reads_loses_its_connection(
    stack_for: Callable[..., ServedApp], engine: Engine, make_key: KeyMaker, own_redis: str
) -> None:
    """The a2a-sdk's event streams set no send timeout of their own: one that nobody read
    held its connection, its stream slot and its listener until the client closed."""
    # Given a running task, and a client that subscribes to it and reads nothing
    api = stack_for(client_stall_s=0.5)
    tenant, token = make_key()
    task_id = a_task_row(engine, tenant=tenant, status="running")
    body = json.dumps(
        {"jsonrpc": "2.0", "id": 1, "method": "SubscribeToTask", "params": {"id": str(task_id)}}
    )
    request = (
        f"POST /a2a/jsonrpc HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {token}\r\n"
        "A2A-Version: 1.0\r\nContent-Type: application/json\r\nAccept: text/event-stream\r\n"
        f"Content-Length: {len(body)}\r\n\r\n{body}"
    )
    log = EventLog(redis.Redis.from_url(own_redis), 600, 64 * 1024 * 1024)
    with contextlib.closing(_sent(api.port, request)) as reader:
        client_port = reader.getsockname()[1]

        # When the task's outputs come faster than it reads
        def filled() -> bool:
            log.append(task_id, OUTPUT, "x" * 40_000, tenant=tenant, trace_id="t")
            return _server_side(api.port, client_port) == "waiting"

        eventually(filled, "the stream to fill the connection")
        slots = api.server.config.app.state.services.streams
        assert slots.open.get(tenant) == 1
        # Then the API drops its side of the connection, and the stream gives its slot back
        eventually(
            lambda: _server_side(api.port, client_port) == "gone",
            "the API to drop the connection",
            timeout_s=20,
        )
        eventually(lambda: tenant not in slots.open, "the stream's slot to be given back")


def test_a_client_that_reads_slowly_keeps_its_connection_to_the_end(
    stack_for: Callable[..., ServedApp], engine: Engine, make_key: KeyMaker
) -> None:
    # Given a task with about 1 MiB to answer, and an API that resets a connection whose
    # client took less than 16 KiB in 2 s while bytes waited for it: a stall this test's
    # reader, descheduled for a second on a loaded machine, does not make
    api = stack_for(client_stall_s=2)
    tenant, token = make_key()
    task_id = _finished_with_a_big_result(engine, tenant)
    # When its client reads it 32 KiB at a time, 0.2 s apart (for some 6 s: the API judges
    # its pace more than once)
    asked = _asked_for(api.port, f"/tasks/{task_id}", token, window=64 * 1024)
    with contextlib.closing(asked) as reader:
        received = bytearray()
        while b"\r\n\r\n" not in received or len(received) < _whole(received):
            chunk = reader.recv(32 * 1024)
            if not chunk:
                break
            received += chunk
            time.sleep(0.2)
    # Then the whole answer came
    head, _, body = bytes(received).partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 200 "), head[:100]
    assert json.loads(body)["result"] == BIG_RESULT


def _whole(received: bytearray) -> int:
    """The length of the answer whose head is in ``received``: head, blank line, body."""
    head, _, _ = bytes(received).partition(b"\r\n\r\n")
    for line in head.split(b"\r\n"):
        name, _, value = line.partition(b":")
        if name.strip().lower() == b"content-length":
            return len(head) + 4 + int(value)
    raise AssertionError(f"no content-length in {head!r}")


def _send_queue(server_port: int, client_port: int) -> int | None:
    """The bytes the kernel holds to send on the server's side of this connection
    (``/proc/net/tcp``'s ``tx_queue``); None when the server holds no such socket."""
    with open("/proc/net/tcp") as table:
        for line in table.read().splitlines()[1:]:
            fields = line.split()
            local, remote = fields[1].split(":")[1], fields[2].split(":")[1]
            if (int(local, 16), int(remote, 16)) == (server_port, client_port):
                return int(fields[4].split(":")[0], 16)
    return None


def _server_side(server_port: int, client_port: int) -> str:
    """The API's side of this connection: "gone", "waiting" (bytes the kernel holds for the
    client) or "idle"."""
    queued = _send_queue(server_port, client_port)
    return "gone" if queued is None else "waiting" if queued else "idle"


def _settled_send_queue(server_port: int, client_port: int) -> int:
    """The bytes the kernel holds to send on the server's side of this connection, once they
    stop growing (``_send_queue``)."""
    samples: list[int] = []

    def settled() -> bool:
        samples.append(_send_queue(server_port, client_port) or 0)
        time.sleep(0.3)
        return len(samples) > 3 and samples[-1] == samples[-2] == samples[-3] > 0

    eventually(settled, "the send queue to stop growing")
    return samples[-1]


# One tenant's tasks of echo, newest last.
TENANTS_ECHO = text(
    "INSERT INTO tasks (id, tenant, capability, queue, status, payload, payload_digest,"
    " payload_size, trace_id, result_ttl_s, created_at, started_at, finished_at, expires_at)"
    " SELECT gen_random_uuid(), :tenant, 'echo', 'echo', 'succeeded', '{}', 'd', 2, 'trace', 60,"
    "  now(), now(), now(), now() + interval '1 day' FROM generate_series(1, :n)"
)
# The listings of tasks running in Postgres now (``broker.db.paging``'s budgeted page).
LISTS_RUNNING = (
    "SELECT count(*) FROM pg_stat_activity WHERE state = 'active'"
    " AND datname = current_database() AND query LIKE '%page_candidates%'"
    " AND backend_type = 'client backend' AND pid <> pg_backend_pid()"
)


def test_one_tenants_task_lists_run_one_at_a_time(
    api: ServedApp, make_key: KeyMaker, engine: Engine, settings: Settings
) -> None:
    """A key that sees only ``invoice.*`` of a tenant whose tasks are all echo reads every one
    of them for an empty page (0.2 s for 40,000). At the request rate each such list took a
    Postgres backend; now a tenant's lists run one at a time per API process."""
    # Given a tenant with 60,000 tasks of echo, and a key of it that sees only invoice.*
    tenant, _ = make_key()
    _, narrow = make_key(["invoice.*"], tenant=tenant)
    with engine.begin() as conn:
        conn.execute(TENANTS_ECHO, {"tenant": tenant, "n": 60_000})

    def list_once(_: int) -> tuple[int, list[Any]]:
        with client_for(api, narrow) as http:
            answer = http.get("/tasks")
            return answer.status_code, answer.json().get("tasks", [])

    try:
        # When the key lists eight times at once
        with at_once(settings, LISTS_RUNNING) as seen, ThreadPoolExecutor(8) as pool:
            answers = list(pool.map(list_once, range(8)))
    finally:
        with engine.begin() as conn:
            conn.execute(text("DELETE FROM tasks WHERE tenant = :t"), {"t": tenant})
    # Then each list is answered (empty: nothing it sees), one at a time in Postgres
    assert answers == [(200, [])] * 8
    assert max(seen) == 1, Counter(seen)


def test_readiness_asked_by_many_at_once_without_a_key_checks_postgres_once_a_second(
    settings: Settings,
) -> None:
    """``/readyz`` needs no key and is outside the waiting cap: each request took a connection
    of the pool every tenant's requests share and sent a query, for anyone who asked."""
    app = create_app(settings)
    checks: list[str] = []
    event.listen(
        app.state.services.engine.sync_engine,
        "before_cursor_execute",
        lambda conn, cursor, statement, *rest: (
            checks.append(statement) if statement.strip() == "SELECT 1" else None
        ),
    )
    with ServedApp(app) as api:

        async def burst() -> tuple[list[int], float]:
            async with httpx.AsyncClient(base_url=api.url, timeout=30) as http:
                started = time.monotonic()
                answers = await asyncio.gather(*(http.get("/readyz") for _ in range(50)))
                return [a.status_code for a in answers], time.monotonic() - started

        statuses, elapsed_s = asyncio.run(burst())
    assert statuses == [200] * 50
    assert 1 <= len(checks) <= 1 + int(elapsed_s / services.READINESS_S), (checks, elapsed_s)


def test_streams_whose_clients_hang_up_at_once_give_their_slots_and_subscriptions_back(
    stack_for: Callable[..., ServedApp], make_key: KeyMaker, own_redis: str
) -> None:
    """A stream ends by cancelling its task when its client leaves. On Python 3.11 a cancel
    that came as the stream's subscription went out was lost (``asyncio.wait_for`` inside
    redis-py returns its result when both land together): 2 to 13 of 200 streams whose
    clients hung up at once held their slots, listeners and subscriptions until their tasks
    ended, and the tenant could open that many fewer. And a stream cancelled while it waited
    for Redis to confirm its subscription gave its slot back but kept its listener and its
    subscription for the life of the process, its queue filling with its task's events: 20
    of 20 tasks, after 50 such hang-ups each."""
    # Given a tenant's queued tasks, nobody serving them
    api = stack_for(max_streams_per_tenant=200, rate_limit_per_s=10_000, rate_limit_burst=10_000)
    tenant, token = make_key()
    with httpx.Client(base_url=api.url, headers={"Authorization": f"Bearer {token}"}) as http:
        ids = [http.post("/tasks", json=QUEUED_ECHO).json()["task_id"] for _ in range(200)]

    # When a client opens a stream of each and hangs up at once (some right away, some a few
    # milliseconds later)
    async def open_and_drop(task_id: str, after_s: float) -> None:
        _, writer = await asyncio.open_connection("127.0.0.1", api.port)
        writer.write(
            f"GET /tasks/{task_id}/events HTTP/1.1\r\nHost: x\r\n"
            f"Authorization: Bearer {token}\r\n\r\n".encode()
        )
        await writer.drain()
        await asyncio.sleep(after_s)
        writer.transport.abort()

    async def scenario() -> None:
        await asyncio.gather(*(open_and_drop(t, 0.001 * (i % 20)) for i, t in enumerate(ids)))
        await asyncio.sleep(0.5)  # the loop closes each aborted socket (a reset) as it runs

    before = _streams_answered()
    asyncio.run(scenario())

    # Then every stream the API began (its answer's head sent) ends and gives its slot back
    slots = api.server.config.app.state.services.streams
    eventually(lambda: _streams_answered() > before, "the API to begin streams")
    eventually(lambda: tenant not in slots.open, "every stream's slot to be given back")
    assert slots.open.get(tenant, 0) == 0
    # And no task's channel is listened to, by the API's hub or on the Redis server
    channels = [channel(t) for t in ids]
    with redis.Redis.from_url(own_redis) as r:
        eventually(
            lambda: [c for c, n in r.pubsub_numsub(*channels) if n],
            "every stream's subscription to be left",
            until=lambda subscribed: not subscribed,
        )
    assert not api.server.config.app.state.services.hub._queues


def _streams_answered() -> float:
    """How many ``GET /tasks/{task_id}/events`` this process's APIs have begun answering 200."""
    wanted = {"method": "GET", "route": "/tasks/{task_id}/events", "status": "200"}
    return sum(
        sample.value
        for metric in metrics.http_requests.collect()
        for sample in metric.samples
        if sample.name.endswith("_total") and sample.labels == wanted
    )
