"""Cancelling a task: the row moves to ``cancelled`` at once (queued or running), and a flag in
Redis tells a running agent through its context. The task id is also published on
``CANCELS_CHANNEL``: a worker running the task's coroutine cancels it there and then. Whatever
the agent does afterwards cannot move the task: every later write is conditional on
``running`` (its session's too). A cancelled turn lets its session's next one go, in the place
its tenant's fair slice of the queue gives it (``backpressure.QueueBound``)."""

from __future__ import annotations

import functools
import logging
import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass

import anyio
import kombu.exceptions
from redis.asyncio import Redis
from sqlalchemy import func, update
from sqlalchemy.ext.asyncio import AsyncEngine

from broker.cache import TimedCache
from broker.db.models import FINAL_COLUMNS, as_task_row, in_sources
from broker.db.models import tasks_table as tasks
from broker.errors import Conflict
from broker.outages import UNAVAILABLE_ERRORS
from broker.registry import cards as card_reads
from broker.registry.model import capability_of
from broker.tasks import turns
from broker.tasks.backpressure import QueueBound
from broker.tasks.dispatch import Dispatcher
from broker.tasks.events import EventLog
from broker.tasks.execution import expiry, moment
from broker.tasks.queries import allowed_by, visible_task
from broker.tasks.resource import CANCEL, TaskRow, parse_task_id, task_error
from broker.tenancy.keys import Principal
from broker.webhooks import outbox
from broker.webhooks.events import event_for_status

log = logging.getLogger("reach.api")

# A cancel's follow-ups meeting an outage (Redis, the Celery broker, Postgres), and how long
# after its commit one may still start.
AFTER_THE_COMMIT = (*UNAVAILABLE_ERRORS, kombu.exceptions.OperationalError)
FOLLOW_UPS_S = 5.0
FLAG_TTL_S = 24 * 3600
CANCELS_CHANNEL = "reach:cancels"


def flag_key(task_id: uuid.UUID | str) -> str:
    return f"reach:cancel:{task_id}"


async def cancel(
    engine: AsyncEngine,
    tenant: str,
    task_id: uuid.UUID,
    *,
    patterns: Sequence[str],
) -> TaskRow | None:
    """The cancelled row, or None when the task is unknown, foreign, outside ``patterns``,
    expired or already final."""
    error = task_error("cancelled", "cancelled by the caller")
    query = (
        update(tasks)
        .where(
            tasks.c.id == task_id,
            tasks.c.tenant == tenant,
            allowed_by(patterns, tasks.c.capability),
            in_sources(CANCEL),
            tasks.c.expires_at > func.now(),
        )
        .values(
            status=CANCEL.target,
            error=error,
            finished_at=moment(),
            expires_at=expiry(),
        )
        .returning(*FINAL_COLUMNS)
    )
    async with engine.begin() as conn:
        row = (await conn.execute(outbox.recording(query))).first()
    return as_task_row(row) if row is not None else None


@dataclass(frozen=True)
class Canceller:
    """The cancel use case: the row, the flag a running agent reads, the stop of a cancellable
    agent's process, the ``task.cancelled`` webhooks and the final event."""

    engine: AsyncEngine
    redis: Redis
    cards: TimedCache
    dispatcher: Dispatcher
    event_log: EventLog
    queue_bound: QueueBound

    async def cancel_visible(self, caller: Principal, task_id: str) -> TaskRow:
        """The cancelled task; ``task_not_found`` when the key may not see it, ``task_final``
        when it has ended already."""
        tid = parse_task_id(task_id)
        row = None if tid is None else await self.cancel_task(caller, tid)
        if row is None:
            current = await visible_task(self.engine, caller, task_id)
            raise Conflict(f"the task is already {current['status']}", code="task_final")
        return row

    async def cancel_task(self, caller: Principal, task_id: uuid.UUID) -> TaskRow | None:
        """The cancelled row; None when nothing was cancelled (see ``cancel``)."""
        row = await cancel(self.engine, caller.tenant, task_id, patterns=caller.sees)
        if row is None:
            return None
        # Everyone it concerns, each on its own: one store away leaves the others told, and
        # none started once FOLLOW_UPS_S have gone by (each waits out its store's timeouts:
        # one after another they outlasted a client's wait, which sent the cancel again and
        # was told 409). The session released before the final event (``Runner.finalize``).
        event = event_for_status(row["status"])
        started = time.monotonic()
        for tell in (
            functools.partial(self._flag, row),
            functools.partial(self._stop_if_cancellable, row),
            functools.partial(anyio.to_thread.run_sync, self.dispatcher.announce, row["id"], event),
            functools.partial(self._release_next_turn, row),
            functools.partial(self.event_log.append_final_async, row),
        ):
            if time.monotonic() - started > FOLLOW_UPS_S:
                log.warning("task %s cancelled; its last follow-ups left to recovery", row["id"])
                break
            try:
                await tell()
            except AFTER_THE_COMMIT as exc:
                # Cancelled all the same: answered 503, the caller was told it was not, and
                # its retry found the task final (409). What was not told is recovered: the
                # worker's finish is refused, the outbox sends the webhooks, the sweeper the
                # next turn, a stream reads the final status from Postgres when quiet.
                log.warning("task %s cancelled; a follow-up failed: %r", row["id"], exc)
            except Exception:  # a store's refusal (out of memory, read-only): the same
                log.exception("task %s cancelled; a follow-up failed", row["id"])
        return row

    async def _flag(self, row: TaskRow) -> None:
        """The running handler's flag (``ctx.cancelled``), and a waiting turn's mark gone."""
        async with self.redis.pipeline(transaction=False) as pipe:
            pipe.set(flag_key(row["id"]), "1", ex=FLAG_TTL_S)
            pipe.publish(CANCELS_CHANNEL, str(row["id"]))
            if turns.of_row(row) is not None:  # a waiting turn's mark (``turns.take_dropped``)
                pipe.delete(turns.DROPPED_KEY.format(row["id"]))
            await pipe.execute()

    async def _release_next_turn(self, row: TaskRow) -> None:
        """The cancelled task's session may run its next turn (``turns``)."""
        place = turns.of_row(row)
        if place is None:
            return
        try:
            async with self.engine.begin() as conn:
                await conn.run_sync(turns.ended, place[0])
                due = await conn.run_sync(turns.next_due, *place)
            if due is not None:  # a turn of the same session: the same tenant's
                behind = await self.queue_bound.republish_behind(due.queue, row["tenant"])
                run = functools.partial(self.dispatcher.run, due, behind=behind)
                await anyio.to_thread.run_sync(run)
        except Exception:  # the cancel stands; the sweeper publishes the next turn
            log.exception("could not release the turn after task %s", row["id"])

    async def _stop_if_cancellable(self, row: TaskRow) -> None:
        if row["agent_id"] is None or row["agent_version"] is None:
            return  # never started
        key = (row["agent_id"], row["agent_version"], capability_of(row["queue"]))
        card = await card_reads.card(self.engine, self.cards, key)
        if card is not None and card.get("cancellable"):
            await anyio.to_thread.run_sync(self.dispatcher.revoke, row["id"])
