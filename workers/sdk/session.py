"""``ctx.session``: the session a task belongs to, as it was when the task was claimed.

The tasks of one session run one at a time, in the order they were accepted, so a turn reads
what the turn before it wrote. ``update`` writes the next revision only while the session is
still at the one read (a compare-and-set); ``mutate`` reads again and retries when someone
else (a ``PUT`` through the API) wrote in between.

    SessionConflict   the session moved past the revision read; retryable: raised out of
                      the handler, the task runs again (a new attempt, a fresh read) while
                      attempts remain
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from broker import jsoncodec
from broker.errors import Retryable

State = dict[str, Any]
# (revision read, new state) -> (revision written, state written); raises SessionConflict.
Writer = Callable[[int, State], tuple[int, State]]
Reader = Callable[[], tuple[int, State]]  # the session as it is now
Change = Callable[[State], State | None]
MUTATE_ATTEMPTS = 5


class SessionConflict(Retryable):
    """The session is no longer at the revision this task read."""

    code = "session_conflict"

    def __init__(self, message: str, *, current_revision: int | None = None) -> None:
        super().__init__(message)
        self.current_revision = current_revision


@dataclass
class Session:
    session_id: str
    revision: int
    state: State
    _write: Writer = field(repr=False)
    _read: Reader = field(repr=False)
    # This attempt wrote a revision: its task is not tried again (it would apply its turn
    # to what it wrote itself).
    written: bool = field(default=False, repr=False)

    def update(self, new_state: State) -> None:
        """Write ``new_state`` as the next revision, if the session is still at
        ``revision``; SessionConflict if not. On success ``state`` and ``revision`` are the
        ones written. Also extends the session's idle TTL; a state over the size limit fails
        the task (``session_too_large``)."""
        if not isinstance(new_state, dict):
            raise TypeError("a session's state is a JSON object (a dict)")
        self.revision, self.state = self._write(self.revision, new_state)
        self.written = True

    def mutate(self, change: Change, *, attempts: int = MUTATE_ATTEMPTS) -> State:
        """Apply ``change`` to a copy of the state and ``update`` with what it returns (or
        with the copy it changed in place, when it returns None). On a conflict, read the
        session again and apply ``change`` to that, up to ``attempts`` times in all; the last
        SessionConflict is raised. Returns the state written."""
        if attempts < 1:
            raise ValueError("attempts must be at least 1")
        for attempt in range(1, attempts + 1):
            # A copy through JSON, in C: the state is JSON, and ``copy.deepcopy`` walks it in
            # Python (a 20-byte turn on a state of 250 KiB of small lists took 193-319 ms
            # of a shared worker, up to five times a call; an audit, 2026-12-06).
            draft = jsoncodec.loads(jsoncodec.dumps(self.state))
            changed = change(draft)
            try:
                self.update(draft if changed is None else changed)
                return self.state
            except SessionConflict:
                if attempt == attempts:
                    raise
                self.revision, self.state = self._read()
        raise AssertionError("unreachable")

    async def update_async(self, new_state: State) -> None:
        """``update`` for an async handler: the write runs off the event loop."""
        await asyncio.to_thread(self.update, new_state)

    async def mutate_async(self, change: Change, *, attempts: int = MUTATE_ATTEMPTS) -> State:
        """``mutate`` for an async handler: reads and writes run off the event loop (and so
        does ``change``, which should only compute the new state)."""
        return await asyncio.to_thread(self.mutate, change, attempts=attempts)
