"""The ways a caller gets the outcome without polling: waiting (sync) and streaming (SSE).

Both last as long as the task may, so each looks at the caller's key again while it lasts
(``api.callers.KeyWatch``): a key revoked meanwhile ends the stream, or the wait with 401,
before the outcome is passed on.

Both begin after the task was accepted, so an outage (Postgres or Redis away, ``OUTAGES``)
meanwhile is no refusal: a wait it cuts answers the task as accepted (``waited``), and a
stream pings on and reads again at its next quiet spell (``task_events``).
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
import logging
import time
import uuid
from collections.abc import AsyncIterator, Awaitable
from dataclasses import dataclass
from typing import Any, TypeVar, cast

from fastapi.responses import JSONResponse, Response
from starlette.types import Receive

from api.callers import KeyWatch
from api.services import Services
from api.sse import OUTAGES, EventStreamResponse, Slot, quiet_s
from broker.observability import metrics
from broker.tasks import queries
from broker.tasks.envelope import Envelope
from broker.tasks.eventhub import POLL_S, EventHub, FinalFromStore
from broker.tasks.events import Event
from broker.tasks.resource import (
    EXPIRED,
    FINAL,
    SHOWN_COLUMNS,
    TaskRow,
    render,
    task_error,
)
from broker.tasks.submission import Accepted
from broker.tenancy.keys import Principal

log = logging.getLogger("reach.replies")
STORE_CHECK_S = POLL_S  # a wait looks at Postgres as often as one look is shared
# How long a stream outlives an outage: then it ends, cleanly, and its client resumes with
# Last-Event-ID (from another API process, perhaps, or once this one can read again).
OUTAGE_S = 30.0


class Gone(enum.Enum):
    """What ``_final_row`` answers for a task no longer there."""

    GONE = "gone"


GONE = Gone.GONE


async def _final_row(svc: Services, tenant: str, task_id: uuid.UUID) -> TaskRow | Gone | None:
    """The task if Postgres has it final, its final event appended to the log first (refused
    when the log has it already): a worker that died between its two writes left it out.
    ``GONE`` when it is not there at all (expired: its ``result_ttl_s`` passed, as it does
    for a queued task no agent took), None while it is queued or running.

    Until then only its status is read, once an interval for all the waits and streams of
    this process on it (``EventHub.polled``); its row (no payload) once it is final."""
    status = await svc.hub.polled(
        ("status", tenant, task_id), lambda: queries.task_status(svc.engine, tenant, task_id)
    )
    if status is None:
        return GONE
    if status not in FINAL:
        return None
    row = await queries.final_task(svc.engine, tenant, task_id)
    if row is None:
        return GONE  # it went since its status was read
    await svc.event_log.append_final_async(row)
    return row


def gone_task(task_id: uuid.UUID, task: TaskRow | None) -> dict[str, Any]:
    """What a stream or a wait ends with when its task went without a final event: the task
    as the caller had it (``task``; its id alone when unknown), ``expired`` with
    ``ttl_exceeded``. Its row has gone the way of every expired task: ``result_ttl_s`` after
    it was accepted, never started (a worker's claim holds it while it runs). Without it a
    stream pinged for ever, holding its tenant's stream slot, and a sync wait waited its
    whole time to answer 202 with a task that was gone."""
    error = task_error("ttl_exceeded", "the task is gone: its result_ttl_s passed before it ended")
    shown = render(task) if task is not None else {"task_id": str(task_id)}
    return shown | {"status": EXPIRED, "error": error}


def _kept(task: TaskRow | None) -> TaskRow | None:
    """What a stream keeps of its task for ``gone_task``, for as long as it lasts: the columns
    the resource shows, but its result (a task that has one is final: the log closes with
    it), nor its payload (a megabyte, in a submit's row)."""
    if task is None:
        return None
    kept = {name: task[name] for name in SHOWN_COLUMNS}  # type: ignore[literal-required]
    return cast(TaskRow, kept | {"result": None})


def final_from_store(
    svc: Services, tenant: str, task_id: uuid.UUID, task: TaskRow | None = None
) -> FinalFromStore:
    """For a quiet stream: the final event, now in the log, or None while the task runs. The
    event returned stands in for the log's only when the log was lost meanwhile, or when the
    task is gone (``gone_task``: ``task`` is the task as the caller had it)."""
    task = _kept(task)

    async def final(last_seq: int) -> Event | None:
        row = await _final_row(svc, tenant, task_id)
        if row is None:
            return None
        if row is GONE:
            data = gone_task(task_id, task)
            trace_id = task["trace_id"] if task is not None else ""
            return Event(
                seq=last_seq + 1, type=EXPIRED, data=data, trace_id=trace_id, at=time.time()
            )
        return Event(
            seq=last_seq + 1,
            type=row["status"],
            data=render(row),
            trace_id=row["trace_id"],
            at=time.time(),
        )

    return final


def key_watch(svc: Services, caller: Principal) -> KeyWatch:
    return KeyWatch(svc.key_cache, svc.engine, caller.key_id)


async def task_events(
    svc: Services, caller: Principal, task_id: uuid.UUID, *, after: int = 0
) -> AsyncIterator[Event | None]:
    """``task_event_pages``, one event at a time (A2A's and MCP's streams map each)."""
    pages = task_event_pages(svc, caller, task_id, after=after)
    async with contextlib.aclosing(pages):  # type: ignore[type-var]  # an async generator
        async for page in pages:
            if page is None:
                yield None
                continue
            for event in page:
                yield event


async def task_event_pages(
    svc: Services,
    caller: Principal,
    task_id: uuid.UUID,
    *,
    after: int = 0,
    quiet_s: float = 2.0,
    task: TaskRow | None = None,
) -> AsyncIterator[list[Event] | None]:
    """The task's events for a stream, in the pages ``EventHub.events`` reads them in (None at
    each quiet spell), each page passed on only while the caller's key is valid; raises
    ``Unauthenticated`` once not. ``task``: the task as the caller read it, for the final
    event of one that goes (``gone_task``).

    An outage does not end the stream: a read of the log or the store that fails is made
    again at the next quiet spell, from the last event passed on, and an event whose key
    cannot be looked at is held until it can, with None meanwhile (the stream pings on). One
    that lasts ``OUTAGE_S`` ends the stream without its final event. Before, the outage
    raised out of a response already started: the client's connection was cut mid-chunk,
    with a 500 in the log."""
    key = key_watch(svc, caller)
    from_store = final_from_store(svc, caller.tenant, task_id, task)
    outage = _Outage()
    last = after
    while True:
        events = svc.hub.events(
            str(task_id), after=last, quiet_s=quiet_s, final_from_store=from_store
        )
        try:
            async with contextlib.aclosing(events):  # type: ignore[type-var]  # an async generator
                async for page in events:
                    while not await _key_checked(key):
                        if outage.outlasted(task_id):
                            return
                        yield None
                        await asyncio.sleep(quiet_s)
                    outage.over()
                    last = page[-1].seq if page else last
                    yield page
            return
        except OUTAGES as exc:
            # The first failure of a spell with its traceback: an outage class also covers a
            # bug's (a statement on a closed connection), which would otherwise pass unseen.
            log.log(
                logging.INFO if outage.going else logging.WARNING,
                "stream of task %s: %s: %s",
                task_id,
                type(exc).__name__,
                exc,
                exc_info=not outage.going,
            )
            if outage.outlasted(task_id):
                return
        yield None
        await asyncio.sleep(quiet_s)


class _Outage:
    """Since when a stream's reads fail: ``outlasted`` notes one more failure and says
    whether they have failed for ``OUTAGE_S``; ``over`` once one succeeds."""

    def __init__(self) -> None:
        self._clock = asyncio.get_running_loop().time
        self._since: float | None = None

    def outlasted(self, task_id: uuid.UUID) -> bool:
        now = self._clock()
        if self._since is None:
            self._since = now
        if now - self._since < OUTAGE_S:
            return False
        log.warning(
            "ended the stream of task %s: Postgres or Redis away for %s s", task_id, OUTAGE_S
        )
        return True

    @property
    def going(self) -> bool:
        """Whether the reads failed already, since the last that succeeded."""
        return self._since is not None

    def over(self) -> None:
        self._since = None


async def _key_checked(key: KeyWatch) -> bool:
    """Whether the caller's key could be looked at (False during an outage); raises
    ``Unauthenticated`` once it is revoked."""
    try:
        await key.check()
    except OUTAGES:
        return False
    return True


def event_stream(
    svc: Services,
    caller: Principal,
    task_id: uuid.UUID,
    *,
    after: int = 0,
    status_code: int = 200,
    headers: dict[str, str] | None = None,
    started: float | None = None,
    slot: Slot | None = None,
    task: TaskRow | None = None,
) -> EventStreamResponse:
    """The task's events as SSE, in a stream slot of the tenant's: ``slot`` when one was taken
    already (before a stream-mode submit), else one taken here (429 when none is left).
    ``task``: as ``task_events``'s."""
    settings = svc.settings
    slot = slot or svc.streams.take(caller.tenant)
    quiet = quiet_s(settings.sse_ping_s)
    return EventStreamResponse(
        task_event_pages(svc, caller, task_id, after=after, quiet_s=quiet, task=_kept(task)),
        send_timeout_s=settings.sse_send_timeout_s,
        ping_s=settings.sse_ping_s,
        status_code=status_code,
        headers=headers,
        started=started,
        slot=slot,
        stopping=svc.stopping,
    )


async def wait_until_final(
    svc: Services,
    caller: Principal,
    task_id: uuid.UUID,
    timeout_s: float,
    *,
    task: TaskRow | None = None,
) -> dict[str, Any] | None:
    """The task (as rendered) once final, or None when ``timeout_s`` passes first; raises
    ``Unauthenticated`` once the caller's key is no longer valid, and an outage as it comes
    (``waited`` answers the task as accepted then). A task that goes meanwhile
    ends the wait at once: ``gone_task`` when the caller gave it (``task``), else None.

    Subscribes, then checks (so a completion during the start is not missed), and looks at
    the task's status in Postgres whenever pub/sub has been quiet for a while (``_final_row``).
    The final event carries the task as the worker wrote it, so the usual path reads nothing
    more.
    """
    hub: EventHub = svc.hub
    key = key_watch(svc, caller)
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s

    async def final_task() -> dict[str, Any] | Gone | None:
        row = await _final_row(svc, caller.tenant, task_id)
        if row is GONE:
            return gone_task(task_id, task) if task is not None else GONE
        return render(row) if row is not None else None

    async with hub.listen(str(task_id)) as live:
        final = await hub.closing_event(str(task_id))
        if final is not None:
            return dict(final.data)
        # A stopping server ends the wait (``api.stopping``), at the next look at the store
        while (remaining := deadline - loop.time()) > 0 and not svc.stopping.is_set():
            try:
                async with asyncio.timeout(min(remaining, STORE_CHECK_S)):
                    event: Event | None = await live.get()
            except TimeoutError:
                event = None
            await key.check()
            if event is None and (found := await final_task()) is not None:
                return None if found is GONE else found
            if event is not None and event.final:
                return dict(event.data)
    return None


async def waited(
    svc: Services,
    caller: Principal,
    row: TaskRow,
    timeout_s: float,
    *,
    receive: Receive | None = None,
) -> tuple[dict[str, Any], bool]:
    """The accepted task ``row`` after a wait of at most ``timeout_s`` (``wait_until_final``),
    as rendered, and whether it is final: as it stands when the wait ends first. Raises
    ``Unauthenticated`` once the caller's key is revoked.

    An outage meanwhile (the key, the task's status, the log or the task itself cannot be
    read) ends the wait with the task as accepted: its caller has its id, and polls. Before,
    it answered 503 with no task id, and a caller that submitted again ran the work twice.
    The key was valid at acceptance; a revoked one is refused whenever it can be looked at.

    ``receive``: the request's, its body read: the wait ends when its client leaves (the
    answer goes nowhere), and with it the request's place among those waiting
    (``api.middleware.WaitingLimit``). It held that place to the end of its wait (30 s), and
    a tenant whose callers gave up on 256 sync submits had every request refused meanwhile."""
    try:
        wait = wait_until_final(svc, caller, row["id"], timeout_s, task=row)
        finished = await (wait if receive is None else _unless_left(receive, wait))
        if finished is LEFT:
            return render(row), False
        if finished is not None:
            return finished, True
        current = await queries.get_task(svc.engine, caller.tenant, row["id"])
    except OUTAGES as exc:
        log.warning("answered task %s as accepted: %s: %s", row["id"], type(exc).__name__, exc)
        return render(row), False
    return as_it_stands(current or row)


def as_it_stands(row: TaskRow) -> tuple[dict[str, Any], bool]:
    """A task read as its wait ended, and whether it is final then: one that became final as
    the wait ran out (its deadline as long as the wait, the store's last look shared with
    other waits) was answered 202, not final, with its final status in it."""
    return render(row), row["status"] in FINAL


class Left(enum.Enum):
    LEFT = "left"  # the client left before the wait ended (``_unless_left``)


LEFT = Left.LEFT
T = TypeVar("T")


async def _unless_left(receive: Receive, wait: Awaitable[T]) -> T | Left:
    """``wait``'s answer, or ``LEFT`` once the request's client has left (``receive``, the
    body read, gives ``http.disconnect`` then); the wait is cancelled."""

    async def left() -> None:
        while (await receive())["type"] != "http.disconnect":
            pass

    waiting, leaving = asyncio.ensure_future(wait), asyncio.ensure_future(left())
    try:
        await asyncio.wait((waiting, leaving), return_when=asyncio.FIRST_COMPLETED)
    finally:
        for task in (waiting, leaving):
            task.cancel()
        await asyncio.gather(waiting, leaving, return_exceptions=True)
    if waiting.cancelled():
        return LEFT
    return waiting.result()


@dataclass(frozen=True)
class Reply:
    """What answering a submit needs of its envelope: its ``reply_mode`` and, for ``sync``,
    how long it waits. Not the envelope: a wait or a stream lasts seconds to minutes, and a
    payload of 1 MiB of JSON is some 20 MiB of Python objects (a million empty lists)."""

    mode: str
    wait_s: float

    @classmethod
    def of(cls, svc: Services, envelope: Envelope) -> Reply:
        return cls(envelope.reply_mode, sync_wait_s(svc, envelope))


async def answer(
    svc: Services,
    caller: Principal,
    reply: Reply,
    accepted: Accepted,
    *,
    started: float,
    slot: Slot | None = None,
    receive: Receive | None = None,
) -> Response:
    """The answer to a submit, in its ``reply.mode``: ``async`` 202 with the task; ``sync``
    200 with the finished task if it finishes within the wait, else 202 (``waited``, which
    ends when the client leaves, given the request's ``receive``);
    ``stream`` its events, in ``slot`` (taken before the submit). A sync wait is 401 once the
    caller's key is revoked."""
    row = accepted.row
    headers = {"Location": f"/tasks/{row['id']}"}
    if accepted.replayed:
        headers["Idempotent-Replayed"] = "true"
    if reply.mode == "stream":
        return event_stream(
            svc, caller, row["id"], headers=headers, started=started, slot=slot, task=row
        )
    if reply.mode == "sync":
        task, final = await waited(svc, caller, row, reply.wait_s, receive=receive)
        metrics.sync_round_trip.observe(time.perf_counter() - started)
        return JSONResponse(task, status_code=200 if final else 202, headers=headers)
    return JSONResponse(render(row), status_code=202, headers=headers)


def sync_wait_s(svc: Services, envelope: Envelope) -> float:
    """How long a sync submit waits: the server's maximum, or less when the deadline is
    nearer."""
    settings = svc.settings
    if envelope.deadline_ms is None:
        return settings.sync_max_wait_s
    return min(settings.sync_max_wait_s, envelope.deadline_ms / 1000)
