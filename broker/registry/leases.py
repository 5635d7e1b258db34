"""The worker side of the registry: advertise cards, hold and renew the lease, go offline."""

from __future__ import annotations

from dataclasses import replace
from datetime import UTC, datetime
from typing import Any, cast

import redis
from sqlalchemy import Engine, func, select
from sqlalchemy.dialects.postgresql import insert

from broker.db.models import agent_cards_table as cards
from broker.db.models import agent_instances_table as instances
from broker.registry import revocations
from broker.registry.model import (
    OFFLINE,
    READY,
    SUSPECT,
    CardRef,
    Lease,
    drain_key,
    home_queue,
    lease_key,
    live_key,
    not_ready_key,
    now_s,
    removed_key,
)


def advertise_cards(engine: Engine, documents: list[dict[str, Any]]) -> None:
    """Upsert each card; a card of an older schema never overwrites a newer one."""
    if not documents:
        return
    with engine.begin() as conn:
        conn.execute(card_upsert(documents))


def card_upsert(documents: list[dict[str, Any]]) -> Any:
    """The statement that upserts the cards (a worker's advertisement, a remote agent's
    registration)."""
    rows = [
        {
            "agent_id": d["agent_id"],
            "version": d["version"],
            "capability": d["capability"],
            "schema_version": d["schema_version"],
            "card": d,
        }
        for d in documents
    ]
    statement = insert(cards).values(rows)
    statement = statement.on_conflict_do_update(
        index_elements=["agent_id", "version", "capability"],
        set_={
            "card": statement.excluded.card,
            "schema_version": statement.excluded.schema_version,
            "last_seen_at": func.now(),
        },
        where=cards.c.schema_version <= statement.excluded.schema_version,
    )
    return statement


def record_instance(engine: Engine, lease: Lease, state: str) -> None:
    """The instance's last known state in Postgres, kept after its lease is gone. Seen and
    stopped by Postgres's clock, the one the reaper (``workers.system.recovery.seen_live``) and
    the janitor compare them with: by the worker's own, a host whose clock ran ahead had its
    dead worker's tasks left running for as long as it was ahead."""
    now = func.now()
    values = {
        "instance": lease.instance,
        "hostname": lease.hostname,
        "pid": lease.pid,
        "state": state,
        "cards": [
            {"agent_id": c.agent_id, "version": c.version, "capability": c.capability}
            for c in lease.cards
        ],
        "lease_ttl_s": lease.lease_ttl_s,
        "started_at": datetime.fromtimestamp(lease.started_at, UTC),
        "last_seen_at": now,
        "stopped_at": now if state == OFFLINE else None,
    }
    statement = insert(instances).values(values)
    statement = statement.on_conflict_do_update(
        index_elements=["instance"],
        set_={k: statement.excluded[k] for k in values if k != "instance"},
    )
    with engine.begin() as conn:
        conn.execute(statement)


def renew(client: redis.Redis, lease: Lease, *, removable: bool = False) -> Lease:
    """Write the lease and index each ready capability until the lease expires, atomically;
    the lease as written. A card of a revoked version is left out of both, in the same
    transaction as the check (a revocation between the two retries it). ``removable``: a
    remote agent's lease, which is not renewed once the agent was removed (``removed_key``):
    a bridge that read the registration before the removal would otherwise route to it
    again until its next tick."""
    if not lease.cards:
        _write(client.pipeline(transaction=True), lease, ())
        return lease
    names = [revocations.member(c.agent_id, c.version) for c in lease.cards]
    removed = removed_key(lease.instance)
    with client.pipeline(transaction=True) as pipe:
        while True:
            try:
                pipe.watch(revocations.REVOKED_KEY, *([removed] if removable else []))  # type: ignore[no-untyped-call]
                if removable and pipe.exists(removed):
                    gone = replace(lease, state=OFFLINE)
                    pipe.multi()
                    _remove(pipe, gone)
                    return gone
                flags = pipe.smismember(revocations.REVOKED_KEY, names)
                revoked = tuple(c for c, gone in zip(lease.cards, flags, strict=True) if gone)
                kept = replace(lease, cards=tuple(c for c in lease.cards if c not in revoked))
                pipe.multi()
                _write(pipe, kept, revoked)
                return kept
            except redis.WatchError:
                continue


def _remove(pipe: Any, lease: Lease) -> None:
    for card in lease.cards:
        pipe.zrem(live_key(card.capability), lease.instance)
    pipe.delete(lease_key(lease.instance))
    pipe.execute()


def _write(pipe: Any, lease: Lease, revoked: tuple[CardRef, ...]) -> None:
    expires_at = lease.heartbeat_at + lease.lease_ttl_s
    pipe.set(lease_key(lease.instance), lease.to_json(), px=int(lease.lease_ttl_s * 1000))
    for card in revoked:
        pipe.zrem(live_key(card.capability), lease.instance)
    for card in lease.cards:
        if lease.state in (READY, SUSPECT) and card.ready:
            pipe.zadd(live_key(card.capability), {lease.instance: expires_at})
        else:
            pipe.zrem(live_key(card.capability), lease.instance)
        # Entries of leases long gone: readers skip them anyway; this keeps the set small.
        # Gone a TTL ago by this clock: one running ahead of its peers' (by less than a TTL)
        # took their live entries for gone and removed them at each of its renewals.
        gone_before = lease.heartbeat_at - lease.lease_ttl_s
        pipe.zremrangebyscore(live_key(card.capability), "-inf", gone_before)
    pipe.execute()


def withdraw(client: redis.Redis, lease: Lease) -> None:
    """Leave every live index at once (draining: no new work is routed here)."""
    pipe = client.pipeline(transaction=True)
    for card in lease.cards:
        pipe.zrem(live_key(card.capability), lease.instance)
    pipe.execute()


def release(client: redis.Redis, lease: Lease) -> None:
    withdraw(client, lease)
    client.delete(lease_key(lease.instance), drain_key(lease.instance))


def admitted_by_a_live_instance(client: redis.Redis, queue: str, tenant: str) -> bool:
    """Whether a live instance serves the card of ``queue`` (a card's queue, or one of its
    instances') ready, for ``tenant``. Instances of one version may
    disagree on its ``tenants`` while a change rolls out, or while bridges take up a card
    registered again: the one that refuses a task is then not the card's last word."""
    capability, agent_id, version = home_queue(queue).split("@")
    live = cast(list[bytes | str], client.zrangebyscore(live_key(capability), now_s(), "+inf"))
    instances = [i.decode() if isinstance(i, bytes) else i for i in live]
    for raw in client.mget([lease_key(i) for i in instances]) if instances else []:
        if raw is None:
            continue
        for card in Lease.from_json(raw).cards:
            same = (card.capability, card.agent_id, card.version) == (capability, agent_id, version)
            if same and card.ready and (card.tenants is None or tenant in card.tenants):
                return True
    return False


def drain_requested(client: redis.Redis, instance: str) -> bool:
    return bool(client.exists(drain_key(instance)))


def not_ready_flags(client: redis.Redis, instance: str, capabilities: list[str]) -> set[str]:
    """Capabilities an agent marked not ready through the SDK (flags with their own TTL)."""
    if not capabilities:
        return set()
    values = client.mget([not_ready_key(instance, c) for c in capabilities])
    return {c for c, v in zip(capabilities, values, strict=True) if v is not None}


def mark_not_ready(client: redis.Redis, instance: str, capability: str, for_s: float) -> None:
    client.set(not_ready_key(instance, capability), "1", px=max(1, int(for_s * 1000)))


def mark_ready(client: redis.Redis, instance: str, capability: str) -> None:
    client.delete(not_ready_key(instance, capability))


def card_of(
    engine: Engine, agent_id: str | None, version: str | None, capability: str
) -> dict[str, Any]:
    """The stored card a task ran under ({} when unknown): its idempotency and attempt limit
    decide what happens to a task whose worker was lost."""
    query = select(cards.c.card).where(cards.c.capability == capability)
    if agent_id is not None:
        query = query.where(cards.c.agent_id == agent_id)
    if version is not None:
        query = query.where(cards.c.version == version)
    with engine.connect() as conn:
        document = conn.execute(query.limit(1)).scalar_one_or_none()
    return document or {}
