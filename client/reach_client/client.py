"""``Reach``: the blocking client. Each method runs a plan of ``reach_client.operations``;
``AsyncReach`` offers the same methods, awaited."""

from __future__ import annotations

import builtins
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from types import TracebackType
from typing import Any, TypeVar, Unpack

import httpx

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


class Reach:
    """The Agent-Reach API. ``base_url`` and ``api_key`` come from the arguments, else
    ``REACH_URL`` / ``REACH_API_KEY``, else the profile file (``reach_client.config``).

    ``max_retries`` bounds retries of connection errors, 429 and 503 (``Retry-After``
    honoured); ``max_answer_bytes`` bounds what one answer, event-stream line or event may
    hold (``reach_client.limits``: 32 MiB, far above the server's default 4 MiB result; raise
    it for a server whose ``REACH_MAX_RESULT_BYTES`` is near it); pass ``http_client`` to
    bring your own ``httpx.Client`` (proxies, TLS, transports): it is then yours to close.
    ``stream_reconnect_s`` (30): how long a stream keeps reconnecting without an event
    once its ``max_retries`` reconnects in a row brought nothing (an API restarting is away
    for seconds; 0: as soon as they run out). ``max_connections`` (100) bounds the
    connections open at once: each stream and each request waiting for an answer holds one
    to its end, and one past them waits for a free one (``APITimeoutError`` saying so,
    after the pool's timeout)."""

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
        max_connections: int = 100,
        http_client: httpx.Client | None = None,
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
        self._http = http_client or httpx.Client(limits=limits)
        self._owns_http = http_client is None
        self.tasks = Tasks(self)
        self.sessions = Sessions(self)
        self.webhooks = Webhooks(self)
        self.agents = Agents(self)
        self.capabilities = Capabilities(self)

    @property
    def base_url(self) -> str:
        return self._settings.base_url

    def run(
        self,
        capability: str,
        payload: Mapping[str, Any],
        *,
        timeout: float | None = None,
        **fields: Unpack[EnvelopeFields],
    ) -> Task:
        """Submit and wait until the task is final (``tasks.submit(..., wait=True)``)."""
        return self.tasks.submit(capability, payload, wait=True, timeout=timeout, **fields)

    def close(self) -> None:
        if self._owns_http:
            self._http.close()

    def __enter__(self) -> Reach:
        return self

    def __exit__(
        self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()

    # -- running plans -----------------------------------------------------------------------

    def _run(self, plan: Plan[T]) -> T:
        try:
            step = next(plan)
            while True:
                if isinstance(step, Sleep):
                    time.sleep(step.seconds)
                    step = plan.send(None)
                    continue
                try:
                    answer = self._send(step)
                except APIConnectionError as exc:
                    step = plan.throw(exc)
                    continue
                step = advance(plan, answer)
        except StopIteration as done:
            return done.value  # type: ignore[no-any-return]

    def _send(self, request: Request) -> Response:
        with self._open(request, ok_only=False) as answer:
            return _read(answer, self._settings.max_answer_bytes)

    @contextmanager
    def _open(self, request: Request, *, ok_only: bool = True) -> Iterator[httpx.Response]:
        """The answer to ``request``, its body unread; with ``ok_only`` an error status raises
        its problem."""
        with translated():
            answer = self._http.send(
                self._http.build_request(**build(self._settings, request)), stream=True
            )
            try:
                if ok_only and not answer.is_success:
                    raise failure_of(_read(answer, self._settings.max_answer_bytes))
                yield answer
            finally:
                answer.close()

    def _events(self, resume: Resume) -> Iterator[Event]:
        while not resume.done:
            try:
                with self._open(resume.request()) as answer, translated():
                    expect_event_stream(answer.status_code, answer.headers)
                    decoder = SSEDecoder(self._settings.max_answer_bytes)
                    for piece in answer.iter_bytes():
                        for event in decoder.decode(piece):
                            if resume.accept(event):
                                yield event
                                if resume.done:
                                    return
                time.sleep(resume.dropped(None))
            except (APIConnectionError, APIStatusError) as exc:
                time.sleep(resume.dropped(exc))

    def _items(self, fetch: Callable[[str | None], Plan[Page[T]]]) -> Iterator[T]:
        cursor: str | None = None
        while True:
            page = self._run(fetch(cursor))
            yield from page.items
            if page.next_cursor is None:
                return
            cursor = page.next_cursor


class Tasks:
    def __init__(self, client: Reach) -> None:
        self._client = client
        self._policy = client._settings.policy

    def submit(
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
            return self._client._run(plan)

    def wait(self, task_id: str, *, timeout: float | None = None) -> Task:
        """The task once final; ``WaitTimeoutError`` after ``timeout`` seconds."""
        return self._client._run(tasks.wait(self._policy, task_id, timeout))

    def stream(self, task_id: str, *, after: int | None = None) -> Iterator[Event]:
        """The task's events from the start (or after event ``after``) through the final one,
        reconnecting with ``Last-Event-ID`` when the connection drops."""
        return self._client._events(Resume(task_id, self._policy, after))

    def get(self, task_id: str) -> Task:
        return self._client._run(tasks.get(self._policy, task_id))

    def cancel(self, task_id: str) -> Task:
        return self._client._run(tasks.cancel(self._policy, task_id))

    def list(
        self,
        *,
        capability: str | None = None,
        status: str | None = None,
        session_id: str | None = None,
        limit: int | None = None,
    ) -> Iterator[Task]:
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

    def list_page(
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
        return self._client._run(plan)


class Sessions:
    def __init__(self, client: Reach) -> None:
        self._client = client
        self._policy = client._settings.policy

    def create(
        self,
        state: Mapping[str, Any] | None = None,
        *,
        metadata: Mapping[str, Any] | None = None,
        ttl_s: int | None = None,
    ) -> Session:
        return self._client._run(sessions.create(self._policy, state, metadata, ttl_s))

    def list(self, *, limit: int | None = None) -> Iterator[Session]:
        """The tenant's live sessions, newest first, fetched ``limit`` per page as you iterate."""
        return self._client._items(
            lambda cursor: sessions.page(self._policy, limit=limit, cursor=cursor)
        )

    def list_page(self, *, limit: int | None = None, cursor: str | None = None) -> Page[Session]:
        return self._client._run(sessions.page(self._policy, limit=limit, cursor=cursor))

    def get(self, session_id: str) -> Session:
        return self._client._run(sessions.get(self._policy, session_id))

    def update(
        self,
        session_id: str,
        state: Mapping[str, Any],
        *,
        revision: int,
        metadata: Mapping[str, Any] | None = None,
    ) -> Session:
        plan = sessions.update(self._policy, session_id, state, revision, metadata)
        return self._client._run(plan)

    def patch(self, session_id: str, merge_patch: Mapping[str, Any], *, revision: int) -> Session:
        return self._client._run(sessions.patch(self._policy, session_id, merge_patch, revision))

    def delete(self, session_id: str) -> None:
        self._client._run(sessions.delete(self._policy, session_id))

    def revisions(
        self, session_id: str, *, limit: int | None = None
    ) -> builtins.list[SessionRevision]:
        return self._client._run(sessions.revisions(self._policy, session_id, limit))


class Webhooks:
    def __init__(self, client: Reach) -> None:
        self._client = client
        self._policy = client._settings.policy

    def create(
        self,
        url: str,
        *,
        events: Sequence[str] | None = None,
        capabilities: Sequence[str] | None = None,
        description: str | None = None,
    ) -> Webhook:
        plan = webhooks.create(self._policy, url, events, capabilities, description)
        return self._client._run(plan)

    def list(self) -> builtins.list[Webhook]:
        return self._client._run(webhooks.list_all(self._policy))

    def get(self, webhook_id: str) -> Webhook:
        return self._client._run(webhooks.get(self._policy, webhook_id))

    def delete(self, webhook_id: str) -> None:
        self._client._run(webhooks.delete(self._policy, webhook_id))

    def deliveries(self, webhook_id: str, *, limit: int | None = None) -> Iterator[Delivery]:
        return self._client._items(
            lambda cursor: webhooks.deliveries(self._policy, webhook_id, limit=limit, cursor=cursor)
        )


class Agents:
    def __init__(self, client: Reach) -> None:
        self._client = client
        self._policy = client._settings.policy

    def list(self) -> builtins.list[Agent]:
        return self._client._run(registry.agents(self._policy))

    def get(self, agent_id: str) -> Agent:
        return self._client._run(registry.agent(self._policy, agent_id))


class Capabilities:
    def __init__(self, client: Reach) -> None:
        self._client = client
        self._policy = client._settings.policy

    def list(self) -> builtins.list[Capability]:
        return self._client._run(registry.capabilities(self._policy))


def _read(answer: httpx.Response, cap: int) -> Response:
    """The answer with its body, read up to the cap of ``reach_client.limits``."""
    body = Buffer("the answer", cap)
    for piece in answer.iter_bytes():
        body.add(piece)
    return response_of(answer, body.take())
