"""How long the registry keeps an instance's row: the janitor's part of the registry.

A worker or remote agent writes its row (``leases.record_instance``) when its state changes,
and nothing deleted one: every worker name ever used (a pod restarted under a new host name)
stayed listed offline forever, and ``GET /agents`` read them all. Now a row not seen live for
``REACH_INSTANCE_RETENTION_S`` is deleted. Its lease in Redis says whether it is live: a row
whose lease is there is marked seen now (``last_seen_at``), so a live instance is never
deleted however long ago it started, and a dead one goes a retention after it was last seen.
With its row go the kombu bindings of its own queues, which stayed in Redis as well.

Cards stay: routing, ``queue_if_unavailable``, channels, revocations and the recovery of a
lost task read them whether or not an instance serves them now."""

from __future__ import annotations

import time
from datetime import datetime
from typing import Any

import redis
from sqlalchemy import ColumnElement, Engine, delete, func, select, update

from broker.db.models import agent_instances_table as instances
from broker.registry.model import card_queue, instance_queue, lease_key


def purge_gone(
    engine: Engine, client: redis.Redis, *, retention_s: float, batch: int, budget_s: float
) -> int:
    """Delete the rows of instances not seen live for ``retention_s``, ``batch`` at a time in
    short transactions, until none is left or ``budget_s`` is spent; how many went."""
    deadline = time.monotonic() + budget_s
    removed = 0
    while True:
        cutoff = func.now() - func.make_interval(0, 0, 0, 0, 0, 0, retention_s)
        names = _not_seen_since(engine, cutoff, batch)
        if not names:
            return removed
        held = client.mget([lease_key(n) for n in names])
        live = [n for n, lease in zip(names, held, strict=True) if lease is not None]
        deleted = _settle(engine, live, [n for n in names if n not in live], cutoff)
        if deleted:
            _unbind(client, deleted)
        removed += len(deleted)
        if len(names) < batch or time.monotonic() >= deadline:
            return removed


def _not_seen_since(engine: Engine, cutoff: ColumnElement[datetime], batch: int) -> list[str]:
    query = (
        select(instances.c.instance)
        .where(instances.c.last_seen_at < cutoff)
        .order_by(instances.c.last_seen_at)
        .limit(batch)
    )
    with engine.connect() as conn:
        return list(conn.execute(query).scalars())


def _settle(
    engine: Engine, live: list[str], gone: list[str], cutoff: ColumnElement[datetime]
) -> list[tuple[str, list[dict[str, Any]]]]:
    """Mark the live ones seen now, delete the gone ones; (instance, cards) of each deleted.
    ``last_seen_at`` is checked again: a row written since it was read (a worker started
    again under the name) stays."""
    with engine.begin() as conn:
        if live:
            seen = update(instances).where(instances.c.instance.in_(live))
            conn.execute(seen.values(last_seen_at=func.now()))
        if not gone:
            return []
        deleted = conn.execute(
            delete(instances)
            .where(instances.c.instance.in_(gone), instances.c.last_seen_at < cutoff)
            .returning(instances.c.instance, instances.c.cards)
        )
        return [(row.instance, row.cards) for row in deleted]


def _unbind(client: redis.Redis, deleted: list[tuple[str, list[dict[str, Any]]]]) -> None:
    """Delete the kombu bindings of the deleted instances' queues, but not of one started
    again under its name since its lease was read (a worker declares its queues, then writes
    its lease): the leases are read again after the rows went, and watched until the bindings
    are deleted. A worker between its declaration and its lease can still lose its bindings."""
    watched = [lease_key(name) for name, _ in deleted]

    def unbind(pipe: redis.client.Pipeline) -> None:
        held = pipe.mget(watched)
        keys = [
            key
            for (name, served), lease in zip(deleted, held, strict=True)
            if lease is None
            for queue in instance_queues(name, served)
            for key in binding_keys(queue)
        ]
        pipe.multi()
        if keys:
            pipe.delete(*keys)

    client.transaction(unbind, *watched)


def instance_queues(instance: str, served: list[dict[str, Any]]) -> list[str]:
    """The queues of an instance's own (hints), one per card it served."""
    return [
        instance_queue(card_queue(c["capability"], c["agent_id"], c["version"]), instance)
        for c in served
    ]


def binding_keys(queue: str) -> list[str]:
    """Where kombu's Redis transport keeps the binding of a queue Celery declared (its
    exchange is named after it): a set kombu routes by, and (kombu 5.7) its copy that marks
    the binding permanent. Declaring a queue writes both and nothing deletes them: once the
    instance is gone for the retention, nothing publishes to its queue (a hint needs a live
    instance, and the sweeper moves what waited there to its card's queue)."""
    return [prefix + queue for prefix in KOMBU_BINDING_PREFIXES]


KOMBU_BINDING_PREFIXES = ("_kombu.binding.", "_kombu.binding_permanent.")
