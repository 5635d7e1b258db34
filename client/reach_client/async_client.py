"""``AsyncReach``: the client for asyncio (and trio, through anyio). The same methods as
``Reach``, awaited, running the same plans of ``reach_client.operations``."""

from __future__ import annotations

import asyncio
import builtins
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from contextlib import asynccontextmanager
from types import TracebackType
from typing import Any, TypeVar, Unpack

import anyio
import httpx

from reach_client.config import ConfigurationError
from reach_client.connection import Settings, build, response_of, translated
from reach_client.errors import APIConnectionError, APIStatusError
from reach_client.limits import MAX_ANSWER_BYTES, Buffer
from reach_client.models import (
    Agent,
    Capability,
    Delivery,
    Event,
    Page,
    Session,
    SessionRevision,
    Task,
    Webhook,
)
from reach_client.operations import registry, sessions, tasks, webhooks
from reach_client.operations.tasks import EnvelopeFields
from reach_client.plans import Plan, Request, Response, Sleep, advance, failure_of
from reach_client.streaming import Resume, SSEDecoder, expect_event_stream

T = TypeVar("T")


class AsyncReach:
    """The Agent-Reach API. ``base_url`` and ``api_key`` come from the arguments, else
    ``REACH_URL`` / ``REACH_API_KEY``, else the profile file (``reach_client.config``).

    ``max_retries`` bounds retries of connection errors, 429 and 503 (``Retry-After``
    honoured); ``max_answer_bytes`` bounds what one answer, event-stream line or event may
    hold (``reach_client.limits``: 32 MiB, far above the server's default 4 MiB result; raise
    it for a server whose ``REACH_MAX_RESULT_BYTES`` is near it); pass ``http_client`` to
    bring your own ``httpx.AsyncClient`` (proxies, TLS, transports): it is then yours to close.
    ``stream_reconnect_s`` (30): how long a stream keeps reconnecting without an event
    once its ``max_retries`` reconnects in a row brought nothing (an API restarting is away
    for seconds; 0: as soon as they run out). ``max_connections`` (1,000) bounds the
    connections open at once: each stream and each request waiting for an answer holds one
    to its end, and one past them waits for a free one (``APITimeoutError`` saying so,
    after the pool's timeout).

    Its connections belong to the event loop that first used them. Used from another loop
    (a client kept at module level across ``asyncio.run`` calls, or across tests), a client
    it made starts afresh there; one you passed in raises ``ConfigurationError`` instead, as
    its pool would fail there with ``RuntimeError: Event loop is closed``."""

    def __init__(
        self,
        base_url: str | None = None,
        api_key: str | None = None,
        *,
        profile: str | None = None,
        timeout: float | httpx.Timeout | None = None,
        max_retries: int = 2,
        max_answer_bytes: int = MAX_ANSWER_BYTES,
        stream_reconnect_s: float = 30.0,
        max_connections: int = 1000,
        http_client: httpx.AsyncClient | None = None,
    ) -> None:
        self._settings = Settings.of(
            base_url,
            api_key,
            profile,
            timeout,
            max_retries,
            max_answer_bytes,
            stream_reconnect_s,
        )
        limits = httpx.Limits(max_connections=max_connections, max_keepalive_connections=100)
        self._http = http_client or httpx.AsyncClient(limits=limits)
        self._owns_http = http_client is None
        self._loop: asyncio.AbstractEventLoop | None = None  # the one its connections are on
        self.tasks = Tasks(self)
        self.sessions = Sessions(self)
        self.webhooks = Webhooks(self)
        self.agents = Agents(self)
        self.capabilities = Capabilities(self)

    @property
    def base_url(self) -> str:
        return self._settings.base_url

    async def run(
        self,
        capability: str,
        payload: Mapping[str, Any],
        *,
        timeout: float | None = None,
        **fields: Unpack[EnvelopeFields],
    ) -> Task:
        """Submit and wait until the task is final (``tasks.submit(..., wait=True)``)."""
        return await self.tasks.submit(capability, payload, wait=True, timeout=timeout, **fields)

    async def close(self) -> None:
        if self._owns_http:
            await self._on_this_loop().aclose()

    async def __aenter__(self) -> AsyncReach:
        return self

    async def __aexit__(
        self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self.close()

    # -- running plans -----------------------------------------------------------------------

    async def _run(self, plan: Plan[T]) -> T:
        try:
            step = next(plan)
            while True:
                if isinstance(step, Sleep):
                    await anyio.sleep(step.seconds)
                    step = plan.send(None)
                    continue
                try:
                    answer = await self._send(step)
                except APIConnectionError as exc:
                    step = plan.throw(exc)
                    continue
                step = advance(plan, answer)
        except StopIteration as done:
            return done.value  # type: ignore[no-any-return]

    def _on_this_loop(self) -> httpx.AsyncClient:
        """The HTTP client for the running event loop (under trio, the one there is)."""
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:  # not asyncio
            return self._http
        if self._loop is None or self._loop is loop:
            self._loop = loop
            return self._http
        if not self._owns_http:
            raise ConfigurationError(
                "this AsyncReach's http_client was first used on another event loop, and "
                "its connections cannot serve this one: make the client on the loop that uses it"
            )
        # The last loop's connections go with its client, unclosed: that loop cannot close
        # them now (it has ended, or runs elsewhere).
        self._http, self._loop = httpx.AsyncClient(), loop
        return self._http

    async def _send(self, request: Request) -> Response:
        async with self._open(request, ok_only=False) as answer:
            return await _read(answer, self._settings.max_answer_bytes)

    @asynccontextmanager
    async def _open(
        self, request: Request, *, ok_only: bool = True
    ) -> AsyncIterator[httpx.Response]:
        """The answer to ``request``, its body unread; with ``ok_only`` an error status raises
        its problem."""
        http = self._on_this_loop()
        with translated():
            answer = await http.send(
                http.build_request(**build(self._settings, request)), stream=True
            )
            try:
                if ok_only and not answer.is_success:
                    raise failure_of(await _read(answer, self._settings.max_answer_bytes))
                yield answer
            finally:
                await answer.aclose()

    async def _events(self, resume: Resume) -> AsyncIterator[Event]:
        while not resume.done:
            try:
                async with self._open(resume.request()) as answer:
                    expect_event_stream(answer.status_code, answer.headers)
                    decoder = SSEDecoder(self._settings.max_answer_bytes)
                    async for piece in _pieces(answer):
                        for event in decoder.decode(piece):
                            if resume.accept(event):
                                yield event
                                if resume.done:
                                    return
                await anyio.sleep(resume.dropped(None))
            except (APIConnectionError, APIStatusError) as exc:
                await anyio.sleep(resume.dropped(exc))

    async def _items(self, fetch: Callable[[str | None], Plan[Page[T]]]) -> AsyncIterator[T]:
        cursor: str | None = None
        while True:
            page = await self._run(fetch(cursor))
            for item in page.items:
                yield item
            if page.next_cursor is None:
                return
            cursor = page.next_cursor


class Tasks:
    def __init__(self, client: AsyncReach) -> None:
        self._client = client
        self._policy = client._settings.policy

    async def submit(
        self,
        capability: str,
        payload: Mapping[str, Any],
        *,
        wait: bool = False,
        timeout: float | None = None,
        **fields: Unpack[EnvelopeFields],
    ) -> Task:
        """Submit an envelope; the task at once, or with ``wait`` once it is final (sync mode,
        then polling past the server's wait; ``WaitTimeoutError`` after ``timeout`` s)."""
        fields["idempotency_key"] = key = tasks.submission_key(fields)
        plan = tasks.submission(
            self._policy, capability, payload, wait=wait, timeout_s=timeout, **fields
        )
        with tasks.keyed(key):
            return await self._client._run(plan)

    async def wait(self, task_id: str, *, timeout: float | None = None) -> Task:
        """The task once final; ``WaitTimeoutError`` after ``timeout`` seconds."""
        return await self._client._run(tasks.wait(self._policy, task_id, timeout))

    def stream(self, task_id: str, *, after: int | None = None) -> AsyncIterator[Event]:
        """The task's events from the start (or after event ``after``) through the final one,
        reconnecting with ``Last-Event-ID`` when the connection drops."""
        return self._client._events(Resume(task_id, self._policy, after))

    async def get(self, task_id: str) -> Task:
        return await self._client._run(tasks.get(self._policy, task_id))

    async def cancel(self, task_id: str) -> Task:
        return await self._client._run(tasks.cancel(self._policy, task_id))

    def list(
        self,
        *,
        capability: str | None = None,
        status: str | None = None,
        session_id: str | None = None,
        limit: int | None = None,
    ) -> AsyncIterator[Task]:
        """Every task that matches, newest first, fetched ``limit`` per page as you iterate."""
        return self._client._items(
            lambda cursor: tasks.page(
                self._policy,
                capability=capability,
                status=status,
                session_id=session_id,
                limit=limit,
                cursor=cursor,
            )
        )

    async def list_page(
        self,
        *,
        capability: str | None = None,
        status: str | None = None,
        session_id: str | None = None,
        limit: int | None = None,
        cursor: str | None = None,
    ) -> Page[Task]:
        plan = tasks.page(
            self._policy,
            capability=capability,
            status=status,
            session_id=session_id,
            limit=limit,
            cursor=cursor,
        )
        return await self._client._run(plan)


class Sessions:
    def __init__(self, client: AsyncReach) -> None:
        self._client = client
        self._policy = client._settings.policy

    async def create(
        self,
        state: Mapping[str, Any] | None = None,
        *,
        metadata: Mapping[str, Any] | None = None,
        ttl_s: int | None = None,
    ) -> Session:
        return await self._client._run(sessions.create(self._policy, state, metadata, ttl_s))

    def list(self, *, limit: int | None = None) -> AsyncIterator[Session]:
        """The tenant's live sessions, newest first, fetched ``limit`` per page as you iterate."""
        return self._client._items(
            lambda cursor: sessions.page(self._policy, limit=limit, cursor=cursor)
        )

    async def list_page(
        self, *, limit: int | None = None, cursor: str | None = None
    ) -> Page[Session]:
        return await self._client._run(sessions.page(self._policy, limit=limit, cursor=cursor))

    async def get(self, session_id: str) -> Session:
        return await self._client._run(sessions.get(self._policy, session_id))

    async def update(
        self,
        session_id: str,
        state: Mapping[str, Any],
        *,
        revision: int,
        metadata: Mapping[str, Any] | None = None,
    ) -> Session:
        plan = sessions.update(self._policy, session_id, state, revision, metadata)
        return await self._client._run(plan)

    async def patch(
        self, session_id: str, merge_patch: Mapping[str, Any], *, revision: int
    ) -> Session:
        return await self._client._run(
            sessions.patch(self._policy, session_id, merge_patch, revision)
        )

    async def delete(self, session_id: str) -> None:
        await self._client._run(sessions.delete(self._policy, session_id))

    async def revisions(
        self, session_id: str, *, limit: int | None = None
    ) -> builtins.list[SessionRevision]:
        return await self._client._run(sessions.revisions(self._policy, session_id, limit))


class Webhooks:
    def __init__(self, client: AsyncReach) -> None:
        self._client = client
        self._policy = client._settings.policy

    async def create(
        self,
        url: str,
        *,
        events: Sequence[str] | None = None,
        capabilities: Sequence[str] | None = None,
        description: str | None = None,
    ) -> Webhook:
        plan = webhooks.create(self._policy, url, events, capabilities, description)
        return await self._client._run(plan)

    async def list(self) -> builtins.list[Webhook]:
        return await self._client._run(webhooks.list_all(self._policy))

    async def get(self, webhook_id: str) -> Webhook:
        return await self._client._run(webhooks.get(self._policy, webhook_id))

    async def delete(self, webhook_id: str) -> None:
        await self._client._run(webhooks.delete(self._policy, webhook_id))

    def deliveries(self, webhook_id: str, *, limit: int | None = None) -> AsyncIterator[Delivery]:
        return self._client._items(
            lambda cursor: webhooks.deliveries(self._policy, webhook_id, limit=limit, cursor=cursor)
        )


class Agents:
    def __init__(self, client: AsyncReach) -> None:
        self._client = client
        self._policy = client._settings.policy

    async def list(self) -> builtins.list[Agent]:
        return await self._client._run(registry.agents(self._policy))

    async def get(self, agent_id: str) -> Agent:
        return await self._client._run(registry.agent(self._policy, agent_id))


class Capabilities:
    def __init__(self, client: AsyncReach) -> None:
        self._client = client
        self._policy = client._settings.policy

    async def list(self) -> builtins.list[Capability]:
        return await self._client._run(registry.capabilities(self._policy))


async def _pieces(answer: httpx.Response) -> AsyncIterator[bytes]:
    with translated():
        async for piece in answer.aiter_bytes():
            yield piece


async def _read(answer: httpx.Response, cap: int) -> Response:
    """The answer with its body, read up to the cap of ``reach_client.limits``."""
    body = Buffer("the answer", cap)
    async for piece in answer.aiter_bytes():
        body.add(piece)
    return response_of(answer, body.take())
