"""A Redis reply lost on the submit's way: the command ran, the API never heard back.

The submit's one Redis call appends the task's ``queued`` event and pushes its message. When
Redis runs it but its reply does not come within the client's timeout, the API cannot tell
a message that went out from one that did not. It withdraws the row only while the task is
still queued; a task a worker has claimed meanwhile was published, and the caller is told
so (202), not 503: a caller told 503 submits again, and the work runs twice.

A proxy on loopback stands between the API and Redis and, once armed, passes the call that
carries the task's message on to Redis but withholds every reply on that connection, as a
Redis stalled past the client's timeout does.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Awaitable, Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from urllib.parse import urlsplit

import httpx
import pytest
from sqlalchemy import Engine, text

from api.app import create_app
from broker.settings import Settings
from tests.eventually import eventually
from tests.integration.conftest import KeyMaker
from tests.integration.stack import ServedApp, free_port, wait_for_task

pytestmark = pytest.mark.usefixtures("worker")

CAPABILITY = "echo"
MESSAGE_MARK = f'"routing_key": "{CAPABILITY}"'.encode()


async def passed(data: bytes) -> bytes | None:
    return data


async def pipe(
    reader: asyncio.StreamReader,
    writer: asyncio.StreamWriter,
    each: Callable[[bytes], Awaitable[bytes | None]] = passed,
) -> None:
    """What ``reader`` reads, written to ``writer``, until either end goes; then ``writer``
    closed (the proxies of the outage tests). ``each`` sees every read first, and may hold
    it back (by waiting) or drop it (``None``)."""
    try:
        while data := await reader.read(65536):
            if (kept := await each(data)) is not None:
                writer.write(kept)
                await writer.drain()
    except ConnectionError:
        pass
    finally:
        writer.close()


class WithholdingProxy:
    """TCP to Redis, in a thread of its own. While ``armed``, a connection whose request
    carries a message for ``CAPABILITY`` gets no reply from then on (Redis still runs it)."""

    def __init__(self, redis_url: str) -> None:
        parts = urlsplit(redis_url)
        self.upstream = (parts.hostname or "127.0.0.1", parts.port or 6379)
        self.port = free_port()
        self.url = parts._replace(netloc=f"127.0.0.1:{self.port}").geturl()
        self.mark = MESSAGE_MARK  # what marks the call whose reply is withheld
        self.armed = threading.Event()
        self.withheld = threading.Event()  # a reply was withheld
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)

    def __enter__(self) -> WithholdingProxy:
        self.thread.start()
        started = asyncio.run_coroutine_threadsafe(
            asyncio.start_server(self._serve, "127.0.0.1", self.port), self.loop
        )
        self.server = started.result(timeout=10)
        return self

    def __exit__(self, *exc: object) -> None:
        asyncio.run_coroutine_threadsafe(self._close(), self.loop).result(timeout=10)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(timeout=10)
        if not self.thread.is_alive():
            self.loop.close()

    async def _close(self) -> None:
        self.server.close()
        others = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
        for task in others:
            task.cancel()
        await asyncio.gather(*others, return_exceptions=True)

    async def _serve(self, client_r: asyncio.StreamReader, client_w: asyncio.StreamWriter) -> None:
        redis_r, redis_w = await asyncio.open_connection(*self.upstream)
        stalled = False

        async def request(data: bytes) -> bytes | None:
            nonlocal stalled
            if self.armed.is_set() and self.mark in data:
                stalled = True
                self.withheld.set()
            return data

        async def reply(data: bytes) -> bytes | None:
            return None if stalled else data

        await asyncio.gather(pipe(client_r, redis_w, request), pipe(redis_r, client_w, reply))


@pytest.fixture
def proxied_api(settings: Settings) -> Iterator[tuple[ServedApp, WithholdingProxy]]:
    with WithholdingProxy(settings.redis_url) as proxy:
        # The broker is the same Redis (Settings.broker_url unset): the message goes out in
        # the call that appends the queued event, through the proxy.
        app = create_app(settings.model_copy(update={"redis_url": proxy.url}))
        with ServedApp(app) as served:
            yield served, proxy


def test_a_task_claimed_after_a_lost_reply_is_accepted_not_refused_and_runs_once(
    proxied_api: tuple[ServedApp, WithholdingProxy],
    make_key: KeyMaker,
    engine: Engine,
) -> None:
    served, proxy = proxied_api
    tenant, token = make_key([CAPABILITY])
    with httpx.Client(
        base_url=served.url, headers={"Authorization": f"Bearer {token}"}, timeout=60
    ) as client:
        warm = client.post("/tasks", json={"capability": CAPABILITY, "payload": {"n": 0}})
        assert warm.status_code == 202, warm.text
        proxy.armed.set()
        answer = client.post("/tasks", json={"capability": CAPABILITY, "payload": {"n": 1}})
        proxy.armed.clear()
        assert proxy.withheld.is_set(), "the proxy never saw the task's message"
        assert answer.status_code == 202, answer.text
        task_id = answer.json()["task_id"]
        done = wait_for_task(client, task_id, {"succeeded", "failed", "expired"}, timeout_s=60)
    assert done["status"] == "succeeded"
    assert done["result"] == {"n": 1}
    with engine.connect() as conn:
        made = conn.execute(
            text("SELECT count(*), max(attempts) FROM tasks WHERE tenant = :t"), {"t": tenant}
        ).one()
    assert tuple(made) == (2, 1)  # the warm-up and this one, each run once


def test_a_replay_answered_while_the_first_submits_reply_was_lost_gets_a_task_that_stays(
    proxied_api: tuple[ServedApp, WithholdingProxy], make_key: KeyMaker
) -> None:
    """From its commit on, a task is what a submit with its idempotency key is answered with,
    before its message has gone out. The first submit's queue reply lost, the task still
    queued, that submit withdrew it (deleted its row) and answered 503: the replay's caller
    held a task id that read 404 and never ran. A task with a key is kept now, for the
    sweeper to publish if its message is not out."""
    served, proxy = proxied_api
    capability = "test.nobody-serves"  # its task stays queued: the old withdraw took it
    proxy.mark = f'"routing_key": "{capability}"'.encode()
    _, token = make_key([capability])
    envelope = {
        "capability": capability,
        "payload": {"n": 1},
        "idempotency_key": "lost-reply-1",
        "queue_if_unavailable": True,
    }
    headers = {"Authorization": f"Bearer {token}"}
    with (
        httpx.Client(base_url=served.url, headers=headers, timeout=60) as first_caller,
        httpx.Client(base_url=served.url, headers=headers, timeout=60) as second_caller,
        ThreadPoolExecutor(1) as pool,
    ):
        # Given a submit whose queue reply is withheld (its row committed, its message out)
        proxy.armed.set()
        first = pool.submit(first_caller.post, "/tasks", json=envelope)
        eventually(proxy.withheld.is_set, "the proxy to withhold the message's reply")
        proxy.armed.clear()
        # When a retry with the same key comes meanwhile
        replay = second_caller.post("/tasks", json=envelope)
        assert (replay.status_code, replay.headers.get("idempotent-replayed")) == (202, "true")
        # Then the first is accepted too, with that same task, once its wait ends
        answer = first.result(timeout=60)
        assert answer.status_code == 202, answer.text
        assert answer.json()["task_id"] == replay.json()["task_id"]
        # And the task is there, queued, for whoever holds its id
        task = second_caller.get(f"/tasks/{replay.json()['task_id']}")
    assert (task.status_code, task.json()["status"]) == (200, "queued")
