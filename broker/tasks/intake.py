"""Submitting a task: the one home of every check and write between a parsed envelope and an
accepted task. The HTTP API calls it; so will every other front door.

The order keeps the cheap checks first and the slow one last: the key's patterns (memory),
the route and the payload (Redis, cached cards), the queue's depth (cached) and, in a
crowded queue, the tenant's part of it (Postgres, cached), then the callback's host name
(a DNS lookup), then what the tenant's tasks hold (``Quota``, cached; it needs the payload's
size, measured with its digest), the insert and the publish. The tenant's rate token is
taken before the envelope is even read (``Door.take``), or, for a small body that had
arrived whole, in the route lookup's own Redis call (``api.deps.read_metered_body``).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

from sqlalchemy.ext.asyncio import AsyncEngine

from broker.cache import TimedCache
from broker.errors import Forbidden, ReachError
from broker.registry.capabilities import any_pattern_allows
from broker.settings import Settings
from broker.tasks import submission
from broker.tasks.admission import Door, admit
from broker.tasks.backpressure import QueueBound, RateLimited
from broker.tasks.dispatch import Dispatcher
from broker.tasks.envelope import Envelope
from broker.tasks.events import EventLog
from broker.tasks.submission import Accepted, GroupInsert
from broker.tenancy.keys import Principal
from broker.tenancy.usage import Quotas
from broker.webhooks.ssrf import HostLookups
from broker.webhooks.subscriptions import vet_callback

log = logging.getLogger("reach.api")


@dataclass(frozen=True)
class Intake:
    settings: Settings
    engine: AsyncEngine
    door: Door
    cards: TimedCache
    queue_bound: QueueBound
    lookups: HostLookups
    inserter: GroupInsert
    dispatcher: Dispatcher
    event_log: EventLog
    quota: Quotas

    async def submit(
        self,
        caller: Principal,
        envelope: Envelope,
        *,
        trace_id: str,
        callback: dict[str, Any] | None = None,
        metered: bool = True,
    ) -> Accepted:
        """The accepted task (or the one its idempotency key already made); raises a
        ReachError with the code that says why not. ``callback``: the task's callback as
        stored, in place of the envelope's (an A2A push config; ``broker.facades.a2a``).
        ``metered``: the tenant's token was taken already; if not, it is taken with the
        route lookup, before anything else reaches Redis or Postgres."""
        if not any_pattern_allows(caller.capabilities, envelope.capability):
            raise Forbidden(
                f"this key may not run {envelope.capability!r}", code="capability_not_allowed"
            )
        try:
            queue = await admit(
                envelope,
                tenant=caller.tenant,
                allowed=caller.capabilities,
                door=self.door,
                engine=self.engine,
                cache=self.cards,
                metered=metered,
            )
            behind = await self.queue_bound.check(
                queue, caller.tenant, turn=envelope.session_id is not None
            )
            if callback is None and envelope.callback is not None:
                callback = envelope.callback.model_dump()
            if callback is not None:
                allow = self.settings.webhook_allow
                url = callback["url"]
                await vet_callback(self.engine, self.lookups, caller.tenant, url, allow=allow)
        except RateLimited:
            raise
        except ReachError as refused:
            # These judge new work (an agent live now, room in the queue, the card's schema
            # as it is now): a retry of a task already accepted is answered with that task.
            replayed = await submission.replay_of(self.engine, caller, envelope)
            if replayed is None:
                raise
            log.info("replayed past %s", refused.code, extra={"task_id": str(replayed.row["id"])})
            return replayed
        accepted = await submission.submit(
            self.inserter,
            self.dispatcher,
            self.event_log,
            caller,
            envelope,
            queue=queue,
            trace_id=trace_id,
            settings=self.settings,
            callback=callback,
            behind=behind,
            quota=self.quota,
        )
        row = accepted.row
        log.info(
            "task accepted",
            extra={
                "task_id": str(row["id"]),
                "capability": envelope.capability,
                "queue": queue,
                "tenant": caller.tenant,
                "payload_digest": row["payload_digest"],
                "payload_size": row["payload_size"],
                "replayed": accepted.replayed,
            },
        )
        return accepted
