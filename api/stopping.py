"""What the API's long answers do once its uvicorn server is told to stop (SIGTERM, Ctrl-C).

uvicorn stops taking connections, then waits for every open one to end. An event stream ended
only with its task, so one of a queued task nobody serves held the process for as long as its
task lived (a day, by default), and a sync wait, an A2A blocking message or an MCP call held it
for its whole wait. ``Stopping`` tells them to end now:

- event streams (``GET /tasks/{id}/events``, stream-mode submits) end cleanly, with the last
  chunk; their clients resume from ``Last-Event-ID`` on another process;
- waits answer with the task as it stands (202, or an MCP call's task id and status to poll);
- sse-starlette's streams (A2A's, and the MCP SDK's) end once the MCP calls in flight have
  answered, or after ``ANSWERS_S``. Its own drain, left on, closed an MCP call's stream the
  moment the server was told to stop, with no answer at all: the call's task ran, and its
  caller never learned its id.

The server is found as sse-starlette finds it: uvicorn's ``SIGTERM`` handler is a method of
the server it runs, in every process it serves from (``--workers`` included). An app served
any other way (a test's server in a thread) never sees it, and its answers end as before.
"""

from __future__ import annotations

import asyncio
import contextlib
import signal
from collections.abc import Iterator
from typing import Any

from sse_starlette.sse import AppStatus

# How often the server's flag is looked at.
POLL_S = 0.5
# At most this long for the MCP calls in flight to answer before sse-starlette's streams end.
ANSWERS_S = 5.0


def _server() -> Any | None:
    """The uvicorn server this process runs, when its ``SIGTERM`` handler is that server's."""
    handler = signal.getsignal(signal.SIGTERM)
    server = getattr(handler, "__self__", None)
    return server if hasattr(server, "should_exit") else None


class Stopping:
    """Set once this process's server should exit; ``watch`` belongs in the app's lifespan."""

    def __init__(self) -> None:
        self.event = asyncio.Event()
        self.answering = 0  # MCP calls in flight (``answer``)
        self._answered = asyncio.Event()  # set while none is
        self._answered.set()

    def is_set(self) -> bool:
        return self.event.is_set()

    @contextlib.contextmanager
    def answer(self) -> Iterator[None]:
        """Around an answer of sse-starlette's that must go out whole before its streams end."""
        self.answering += 1
        self._answered.clear()
        try:
            yield
        finally:
            self.answering -= 1
            if not self.answering:
                self._answered.set()

    async def watch(self) -> None:
        # sse-starlette ends its streams when this says so, not at the signal: set in the
        # process that serves (the lifespan runs this), not in every one that imports us
        AppStatus.enable_automatic_graceful_drain = False
        # uvicorn's flag is a plain attribute, which nothing announces: looked at, then
        while (server := _server()) is None or not server.should_exit:  # noqa: ASYNC110
            await asyncio.sleep(POLL_S)
        self.event.set()
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(ANSWERS_S):
                await self._answered.wait()
        AppStatus.should_exit = True
