"""Server-sent events as a plain ASGI response, so that every write has a deadline.

A client that stops reading fills its socket buffer; the next write then waits, and after
``send_timeout_s`` the stream is dropped instead of pinning memory. A client that disconnects
ends the stream at once; the task itself is never affected. A stream whose key is revoked
(the events raise ``Unauthenticated``) ends too, without its final event: the stream contract
has no error event, and the client's reconnect is answered 401. So does one whose events
raise an outage (``OUTAGES``; ``api.replies.task_events`` outlives a short one): the client
resumes with ``Last-Event-ID``. Raised out of a response already started, either cut the
client's connection mid-chunk and logged a 500.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import time
from collections.abc import AsyncIterator
from typing import Any

from starlette.responses import Response
from starlette.types import Receive, Scope, Send

from api.stopping import Stopping
from broker import outages
from broker.errors import ReachError, Unauthenticated, Unavailable
from broker.observability import metrics
from broker.tasks.events import Event

log = logging.getLogger("reach.sse")
PING = b": ping\n\n"
HEADERS = {
    "Cache-Control": "no-cache",
    "X-Accel-Buffering": "no",  # nginx would otherwise buffer the stream
    "Connection": "keep-alive",
}
# What a request answers 503 ``service_unavailable`` for: Postgres or Redis away.
OUTAGES = (*outages.UNAVAILABLE_ERRORS, Unavailable)
QUIET_MAX_S = 2.0  # the longest a stream's reader sleeps between two looks at its log


def quiet_s(ping_s: float) -> float:
    """How long a stream's reader sleeps when nothing comes: at most ``QUIET_MAX_S``, and a
    whole part of ``ping_s``, so that a ping falls due at a wake-up."""
    return ping_s / math.ceil(ping_s / QUIET_MAX_S)


def ping_due(silent_s: float, ping_s: float) -> bool:
    """Whether a stream silent for ``silent_s`` sends its ping, at the wake-up nearest
    ``ping_s``: a ping due between two wake-ups 2 s apart went out at the later one (at 16 s
    of 15, past a proxy's 15 s idle timeout)."""
    return silent_s >= ping_s - quiet_s(ping_s) / 2


class TooManyStreams(ReachError):
    code = "too_many_streams"


class StreamSlots:
    """The streams each tenant holds open in this process, at most ``per_tenant`` at once. The
    API's event loop is the only user: no lock."""

    def __init__(self, per_tenant: int) -> None:
        self.per_tenant = per_tenant
        self.open: dict[str, int] = {}

    def take(self, tenant: str) -> Slot:
        """A slot for one more stream of ``tenant``; raises ``TooManyStreams`` (429) when it
        holds ``per_tenant`` already. Taken before anything is written (a stream-mode submit)."""
        held = self.open.get(tenant, 0)
        if held >= self.per_tenant:
            raise TooManyStreams(
                f"this tenant holds {held} streams open here already; close one, or retry later",
                limit=self.per_tenant,
            )
        self.open[tenant] = held + 1
        return Slot(self, tenant)

    def _give_back(self, tenant: str) -> None:
        left = self.open.get(tenant, 0) - 1
        if left > 0:
            self.open[tenant] = left
        else:
            self.open.pop(tenant, None)


class Slot:
    """One stream's place; ``release`` gives it back, once (and so does leaving ``with``)."""

    def __init__(self, slots: StreamSlots, tenant: str) -> None:
        self._slots: StreamSlots | None = slots
        self.tenant = tenant

    def release(self) -> None:
        slots, self._slots = self._slots, None
        if slots is not None:
            slots._give_back(self.tenant)

    def __enter__(self) -> Slot:
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()


class EventStreamResponse(Response):
    media_type = "text/event-stream"

    def __init__(
        self,
        events: AsyncIterator[list[Event] | None],
        *,
        send_timeout_s: float,
        ping_s: float,
        status_code: int = 200,
        headers: dict[str, str] | None = None,
        started: float | None = None,
        slot: Slot | None = None,
        stopping: Stopping | None = None,
    ) -> None:
        super().__init__(status_code=status_code, headers={**HEADERS, **(headers or {})})
        # A stream has no length: drop the content-length: 0 that Response adds for no body.
        self.raw_headers = [(k, v) for k, v in self.raw_headers if k != b"content-length"]
        self.events = events
        self.send_timeout_s = send_timeout_s
        self.ping_s = ping_s
        self.started = started  # perf_counter() at the request, to time the first event
        self.slot = slot  # given back when the stream ends, however it ends
        self.stopping = stopping  # the stream ends cleanly once it is set

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        loop = asyncio.get_running_loop()
        last_write = loop.time()
        begun = False

        async def write(body: bytes, more: bool = True) -> None:
            nonlocal last_write
            message = {"type": "http.response.body", "body": body, "more_body": more}
            async with asyncio.timeout(self.send_timeout_s):
                await send(message)
            last_write = loop.time()

        async def stream() -> None:
            nonlocal begun
            await send(
                {
                    "type": "http.response.start",
                    "status": self.status_code,
                    "headers": self.raw_headers,
                }
            )
            begun = True
            try:
                async for page in self.events:  # a page of the log in one write
                    if page:
                        await write(b"".join([event.sse() for event in page]))
                        if self.started is not None:
                            metrics.stream_first_event.observe(time.perf_counter() - self.started)
                            self.started = None
                    elif ping_due(loop.time() - last_write, self.ping_s):
                        await write(PING)  # keeps proxies from cutting an idle stream
            except Unauthenticated:
                log.info("ended an SSE stream: its key is no longer valid")
            except OUTAGES as exc:
                log.warning("ended an SSE stream: %s: %s", type(exc).__name__, exc)
            await write(b"", more=False)

        async def disconnected() -> None:
            while (await receive())["type"] != "http.disconnect":
                pass

        streaming = asyncio.create_task(stream())
        watching = asyncio.create_task(disconnected())
        tasks: list[asyncio.Task[Any]] = [streaming, watching]
        if self.stopping is not None:
            tasks.append(stop := asyncio.create_task(self.stopping.event.wait()))
        try:
            done, _ = await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
            if streaming in done and (exc := streaming.exception()) is not None:
                if isinstance(exc, TimeoutError):
                    log.info("dropped an SSE client that stopped reading")
                else:
                    raise exc
            elif self.stopping is not None and stop in done and not streaming.done():
                # The server is stopping: the stream ends whole (a write is never cut, its
                # bytes are the transport's once ``send`` is called), and its client resumes
                # from its last event on another process.
                streaming.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await streaming
                if begun:
                    with contextlib.suppress(Exception):
                        await write(b"", more=False)
                log.info("ended an SSE stream: the server is stopping")
        finally:
            try:
                for task in tasks:
                    task.cancel()
                    with contextlib.suppress(asyncio.CancelledError, Exception):
                        await task
                with contextlib.suppress(Exception):
                    await self.events.aclose()  # type: ignore[attr-defined]
            finally:
                if self.slot is not None:
                    self.slot.release()
