"""The schema. Alembic migrations (``migrations/``) are the only way it changes in a database;
``tests/integration/test_migrations.py`` proves the two agree."""

from __future__ import annotations

import uuid
from datetime import datetime
from typing import Any, cast

from sqlalchemy import (
    BigInteger,
    Boolean,
    CheckConstraint,
    ColumnElement,
    DateTime,
    Float,
    ForeignKey,
    Index,
    Integer,
    MetaData,
    SmallInteger,
    String,
    Table,
    Text,
    func,
    or_,
    text,
)
from sqlalchemy.dialects.postgresql import ARRAY, JSONB, UUID
from sqlalchemy.engine import Row
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column

from broker.tasks.resource import QUEUED, RUNNING, STATUSES, Move, TaskRow

NAMING = {
    "ix": "ix_%(table_name)s_%(column_0_N_name)s",
    "uq": "uq_%(table_name)s_%(column_0_N_name)s",
    "ck": "ck_%(table_name)s_%(constraint_name)s",
    "fk": "fk_%(table_name)s_%(column_0_name)s_%(referred_table_name)s",
    "pk": "pk_%(table_name)s",
}

TZ = DateTime(timezone=True)


# The tasks ``broker.tasks.turns`` asks for (``_waiting_or_running``); its statements imply
# this, so the planner may use the index it bounds.
UNFINISHED_TURNS = f"session_id IS NOT NULL AND status IN ('{QUEUED}', '{RUNNING}')"


class Base(DeclarativeBase):
    metadata = MetaData(naming_convention=NAMING)


class Task(Base):
    __tablename__ = "tasks"

    id: Mapped[uuid.UUID] = mapped_column(UUID(as_uuid=True), primary_key=True)
    tenant: Mapped[str] = mapped_column(String(64))
    capability: Mapped[str] = mapped_column(String(128))
    # The queue it was published to: the capability's, a card's or an instance's
    # (``broker.registry.model``).
    queue: Mapped[str] = mapped_column(String(512))
    status: Mapped[str] = mapped_column(String(16))
    payload: Mapped[Any] = mapped_column(JSONB)
    payload_digest: Mapped[str] = mapped_column(String(64))
    payload_size: Mapped[int] = mapped_column(Integer)
    result: Mapped[Any | None] = mapped_column(JSONB)
    # The bytes of its metadata and of its result as canonical JSON, measured where each is
    # written (the submit, the worker's finish): what a listing's byte budget adds, instead
    # of turning up to a megabyte of JSON into text per row. NULL: written before they were
    # kept (migration 0022), measured as text.
    metadata_size: Mapped[int | None] = mapped_column(Integer)
    result_size: Mapped[int | None] = mapped_column(Integer)
    error: Mapped[Any | None] = mapped_column(JSONB)
    progress: Mapped[Any | None] = mapped_column(JSONB)
    attempts: Mapped[int] = mapped_column(Integer, server_default=text("0"))
    max_attempts: Mapped[int | None] = mapped_column(SmallInteger)
    priority: Mapped[int | None] = mapped_column(SmallInteger)
    trace_id: Mapped[str] = mapped_column(String(32))
    session_id: Mapped[str | None] = mapped_column(String(128))
    # Its place in its session's order (``broker.tasks.turns``): 1, 2, ... as accepted.
    session_turn: Mapped[int | None] = mapped_column(Integer)
    source: Mapped[str | None] = mapped_column(String(128))
    meta: Mapped[Any] = mapped_column("metadata", JSONB, server_default=text("'{}'::jsonb"))
    idempotency_key: Mapped[str | None] = mapped_column(String(255))
    agent_id: Mapped[str | None] = mapped_column(String(128))
    agent_version: Mapped[str | None] = mapped_column(String(64))
    instance: Mapped[str | None] = mapped_column(String(255))
    result_ttl_s: Mapped[int] = mapped_column(Integer)
    created_at: Mapped[datetime] = mapped_column(TZ, server_default=func.now())
    started_at: Mapped[datetime | None] = mapped_column(TZ)
    finished_at: Mapped[datetime | None] = mapped_column(TZ)
    deadline_at: Mapped[datetime | None] = mapped_column(TZ)
    # When a task queued again (``execution.requeue``) is due: its requeue plus the retry's
    # delay. The sweep counts its wait from then; NULL: it was never queued again.
    retry_at: Mapped[datetime | None] = mapped_column(TZ)
    # When it first wrote its session (``broker.sessions.compare_and_set``); NULL: it has
    # not. A claim of it again fails it (a turn is applied once).
    session_written_at: Mapped[datetime | None] = mapped_column(TZ)
    expires_at: Mapped[datetime] = mapped_column(TZ)
    # The envelope's callback, {"url", "events"}: where this task's own webhook goes.
    callback: Mapped[Any | None] = mapped_column(JSONB)

    __table_args__ = (
        CheckConstraint("status IN (" + ", ".join(f"'{s}'" for s in STATUSES) + ")", name="status"),
        # Listing is by tenant, newest first (ids are time-ordered UUIDv7), optionally filtered.
        Index("ix_tasks_tenant_id", "tenant", "id"),
        Index("ix_tasks_tenant_capability_id", "tenant", "capability", "id"),
        Index("ix_tasks_tenant_status_id", "tenant", "status", "id"),
        Index("ix_tasks_expires_at", "expires_at"),
        # The measured figures of GET /capabilities read the last minutes of finished tasks.
        Index("ix_tasks_finished_at", "finished_at"),
        # A capability's series (GET /capabilities/{capability}/series): one tenant's tasks
        # of the capability that served them (``broker.registry.figures``), by finished_at.
        # Finished ones only: a submission does not pay for it, the finish does.
        Index(
            "ix_tasks_tenant_served_finished_at",
            "tenant",
            text("split_part(queue, '@', 1)"),
            "finished_at",
            postgresql_where=text("finished_at IS NOT NULL"),
        ),
        # The sweep's groups of queued tasks (``execution.stale_queued``): each (tenant,
        # queue) found by one probe, its oldest a range of it. Queued rows only: small.
        Index(
            "ix_tasks_queued_tenant_queue_created_at",
            "tenant",
            "queue",
            "created_at",
            postgresql_where=text("status = 'queued'"),
        ),
        # ... and a group's tasks outside any session, its oldest a range of this: the turns
        # waiting behind another are not in it (the sweep reads each session's first instead,
        # ``turns.session_heads``), so their number costs the sweep nothing.
        Index(
            "ix_tasks_queued_no_session_tenant_queue_created_at",
            "tenant",
            "queue",
            "created_at",
            postgresql_where=text("status = 'queued' AND session_id IS NULL"),
        ),
        # The sweep's expiry of queued tasks past their deadline (``execution.overdue_query``):
        # each tenant found by one probe, its earliest a range of it. Without it each sweep
        # read every queued task to find the overdue ones.
        Index(
            "ix_tasks_queued_tenant_deadline_at",
            "tenant",
            "deadline_at",
            postgresql_where=text("status = 'queued' AND deadline_at IS NOT NULL"),
        ),
        # The running tasks of an instance, or of all (``execution.running_tasks``): every
        # lease keeper's and bridge's orphan check and the reaper read them each tick. Running
        # rows only: small. Without it each read was a scan of the whole table (262 ms at
        # 2 million rows for the reaper's, every 5 s; 125 ms for each worker's).
        Index(
            "ix_tasks_running_instance_started_at",
            "instance",
            "started_at",
            postgresql_where=text("status = 'running'"),
        ),
        # A session's tasks: ``GET /tasks?session_id=`` reads it, not all the tenant's.
        Index(
            "ix_tasks_session_id_session_turn",
            "session_id",
            "session_turn",
            postgresql_where=text("session_id IS NOT NULL"),
        ),
        # A session's earlier turns that are not final yet: what a claim and a release ask
        # (``broker.tasks.turns``). Only unfinished ones, so the probe reads none of the
        # session's finished turns: with all of them indexed, a session of 50,000 finished
        # turns had each claim and release read and filter out 50,000 rows.
        Index(
            "ix_tasks_session_id_session_turn_unfinished",
            "session_id",
            "session_turn",
            postgresql_where=text(UNFINISHED_TURNS),
        ),
        # The database decides idempotency, not a read-then-write.
        Index(
            "uq_tasks_idempotency",
            "tenant",
            "capability",
            "idempotency_key",
            unique=True,
            postgresql_where=text("idempotency_key IS NOT NULL"),
        ),
    )


class TenantUsage(Base):
    """The bytes a tenant's tasks, sessions and webhook deliveries hold
    (``broker.tenancy.usage``): kept by triggers on ``tasks`` (migration 0016), ``sessions``
    and ``session_revisions`` (0017) and ``webhook_deliveries`` (0023), in shards a writer's
    backend picks, summed on read."""

    __tablename__ = "tenant_usage"

    tenant: Mapped[str] = mapped_column(String(64), primary_key=True)
    shard: Mapped[int] = mapped_column(SmallInteger, primary_key=True, autoincrement=False)
    bytes: Mapped[int] = mapped_column(BigInteger)


class ApiKey(Base):
    __tablename__ = "api_keys"

    key_id: Mapped[str] = mapped_column(String(32), primary_key=True)
    tenant: Mapped[str] = mapped_column(String(64), index=True)
    secret_hash: Mapped[str] = mapped_column(String(64))
    capabilities: Mapped[list[str]] = mapped_column(ARRAY(Text))
    is_admin: Mapped[bool] = mapped_column(Boolean, server_default=text("false"))
    # Manages its tenant: the callback secret, every webhook, every task of the tenant.
    tenant_admin: Mapped[bool] = mapped_column(Boolean, server_default=text("false"))
    name: Mapped[str | None] = mapped_column(String(128))
    created_at: Mapped[datetime] = mapped_column(TZ, server_default=func.now())
    revoked_at: Mapped[datetime | None] = mapped_column(TZ)


class AgentCard(Base):
    """A card as its agent last advertised it. Kept after the agent is gone, so an operator
    can see what vanished and when."""

    __tablename__ = "agent_cards"

    agent_id: Mapped[str] = mapped_column(String(128), primary_key=True)
    version: Mapped[str] = mapped_column(String(64), primary_key=True)
    capability: Mapped[str] = mapped_column(String(128), primary_key=True)
    # Written only by a worker whose card schema is at least as new as the stored one.
    schema_version: Mapped[int] = mapped_column(SmallInteger)
    card: Mapped[Any] = mapped_column(JSONB)
    first_seen_at: Mapped[datetime] = mapped_column(TZ, server_default=func.now())
    last_seen_at: Mapped[datetime] = mapped_column(TZ, server_default=func.now())

    __table_args__ = (Index("ix_agent_cards_capability", "capability"),)


class AgentInstance(Base):
    """A worker instance that held a lease: its last known state, for the read side."""

    __tablename__ = "agent_instances"

    instance: Mapped[str] = mapped_column(String(255), primary_key=True)
    hostname: Mapped[str] = mapped_column(String(255))
    pid: Mapped[int] = mapped_column(Integer)
    state: Mapped[str] = mapped_column(String(16))
    # [{"agent_id", "version", "capability"}] it served.
    cards: Mapped[Any] = mapped_column(JSONB)
    lease_ttl_s: Mapped[float] = mapped_column(Float)
    started_at: Mapped[datetime] = mapped_column(TZ)
    last_seen_at: Mapped[datetime] = mapped_column(TZ)
    stopped_at: Mapped[datetime | None] = mapped_column(TZ)


class AgentChannel(Base):
    """A named channel of an agent (``stable``, ``canary``): the weight of each version in
    the traffic routed through it. Set by operators."""

    __tablename__ = "agent_channels"

    agent_id: Mapped[str] = mapped_column(String(128), primary_key=True)
    channel: Mapped[str] = mapped_column(String(63), primary_key=True)
    # {"2.3.1": 90, "2.4.0": 10}
    versions: Mapped[Any] = mapped_column(JSONB)
    updated_at: Mapped[datetime] = mapped_column(TZ, server_default=func.now())


class AgentRevocation(Base):
    """A version taken out of routing for good: no route picks it, its instances' leases
    drop it."""

    __tablename__ = "agent_revocations"

    agent_id: Mapped[str] = mapped_column(String(128), primary_key=True)
    version: Mapped[str] = mapped_column(String(64), primary_key=True)
    revoked_at: Mapped[datetime] = mapped_column(TZ, server_default=func.now())
    revoked_by: Mapped[str] = mapped_column(String(64))


class RemoteAgent(Base):
    """An agent the broker reaches over the network, as an operator registered it. Its cards
    are in ``agent_cards`` like any agent's; ``cards`` keeps the ones it was registered with,
    for the bridge. The secret is kept in clear: signing the calls needs it."""

    __tablename__ = "remote_agents"

    agent_id: Mapped[str] = mapped_column(String(64), primary_key=True)
    version: Mapped[str] = mapped_column(String(64))
    protocol: Mapped[str] = mapped_column(String(16))
    url: Mapped[str] = mapped_column(String(2048))
    capability_prefix: Mapped[str | None] = mapped_column(String(64))
    cards: Mapped[Any] = mapped_column(JSONB)
    secret: Mapped[str] = mapped_column(Text)
    created_at: Mapped[datetime] = mapped_column(TZ, server_default=func.now())
    updated_at: Mapped[datetime] = mapped_column(TZ, server_default=func.now())


class Session(Base):
    """A conversation's state: a snapshot with a revision that only grows (``broker.sessions``).
    ``expires_at`` moves on with every write (the idle TTL, ``ttl_s``)."""

    __tablename__ = "sessions"

    id: Mapped[str] = mapped_column(String(128), primary_key=True)
    tenant: Mapped[str] = mapped_column(String(64))
    revision: Mapped[int] = mapped_column(Integer)
    state: Mapped[Any] = mapped_column(JSONB)
    meta: Mapped[Any] = mapped_column("metadata", JSONB)
    ttl_s: Mapped[int] = mapped_column(Integer)
    # Turns handed out to its tasks so far: the next task accepted takes turns + 1.
    turns: Mapped[int] = mapped_column(Integer, server_default=text("0"))
    created_at: Mapped[datetime] = mapped_column(TZ, server_default=func.now())
    updated_at: Mapped[datetime] = mapped_column(TZ, server_default=func.now())
    expires_at: Mapped[datetime] = mapped_column(TZ)

    __table_args__ = (
        Index("ix_sessions_tenant_id", "tenant", "id"),
        Index("ix_sessions_expires_at", "expires_at"),
        # A tenant's sessions newest first, a page at a time (``GET /sessions``).
        Index("ix_sessions_tenant_created_at_id", "tenant", "created_at", "id"),
    )


class SessionRevision(Base):
    """Each revision of a session as it was written, and the task that wrote it (null: the
    API). Gone with its session."""

    __tablename__ = "session_revisions"

    session_id: Mapped[str] = mapped_column(
        String(128), ForeignKey("sessions.id", ondelete="CASCADE"), primary_key=True
    )
    revision: Mapped[int] = mapped_column(Integer, primary_key=True)
    tenant: Mapped[str] = mapped_column(String(64))
    state: Mapped[Any] = mapped_column(JSONB)
    task_id: Mapped[uuid.UUID | None] = mapped_column(UUID(as_uuid=True))
    created_at: Mapped[datetime] = mapped_column(TZ, server_default=func.now())


class Webhook(Base):
    """A tenant's subscription. The secret is kept in clear: signing needs it."""

    __tablename__ = "webhooks"

    id: Mapped[uuid.UUID] = mapped_column(UUID(as_uuid=True), primary_key=True)
    tenant: Mapped[str] = mapped_column(String(64))
    url: Mapped[str] = mapped_column(String(2048))
    events: Mapped[list[str]] = mapped_column(ARRAY(Text))
    # Capability patterns ("invoice.*"); empty: every capability.
    capabilities: Mapped[list[str]] = mapped_column(ARRAY(Text))
    description: Mapped[str | None] = mapped_column(String(256))
    secret: Mapped[str] = mapped_column(Text)
    previous_secret: Mapped[str | None] = mapped_column(Text)
    previous_secret_expires_at: Mapped[datetime | None] = mapped_column(TZ)
    disabled_at: Mapped[datetime | None] = mapped_column(TZ)
    disabled_reason: Mapped[str | None] = mapped_column(String(256))
    created_at: Mapped[datetime] = mapped_column(TZ, server_default=func.now())

    __table_args__ = (Index("ix_webhooks_tenant_id", "tenant", "id"),)


class CallbackSecret(Base):
    """The secret that signs a tenant's per-task callbacks."""

    __tablename__ = "callback_secrets"

    tenant: Mapped[str] = mapped_column(String(64), primary_key=True)
    secret: Mapped[str] = mapped_column(Text)
    previous_secret: Mapped[str | None] = mapped_column(Text)
    previous_secret_expires_at: Mapped[datetime | None] = mapped_column(TZ)
    created_at: Mapped[datetime] = mapped_column(TZ, server_default=func.now())


class WebhookBody(Base):
    """A message body, stored once for every endpoint of one event of a task (fifty
    subscriptions to a task's result store it once, not fifty times). It carries the task
    resource, the result too, so it lives as long as the task: removed at ``expires_at``."""

    __tablename__ = "webhook_bodies"

    id: Mapped[uuid.UUID] = mapped_column(UUID(as_uuid=True), primary_key=True)
    body: Mapped[str] = mapped_column(Text)
    expires_at: Mapped[datetime] = mapped_column(TZ, index=True)


class WebhookDelivery(Base):
    """One message to one endpoint: the same body and webhook-id on every attempt.

    ``task_id`` has no foreign key: the delivery log outlives a short-lived task."""

    __tablename__ = "webhook_deliveries"

    id: Mapped[uuid.UUID] = mapped_column(UUID(as_uuid=True), primary_key=True)
    tenant: Mapped[str] = mapped_column(String(64))
    # NULL: the task's own callback.
    webhook_id: Mapped[uuid.UUID | None] = mapped_column(
        UUID(as_uuid=True), ForeignKey("webhooks.id", ondelete="CASCADE")
    )
    task_id: Mapped[uuid.UUID] = mapped_column(UUID(as_uuid=True))
    event_type: Mapped[str] = mapped_column(String(32))
    # One delivery per (task, event, endpoint) for final events, however often fanout runs.
    dedupe_key: Mapped[str | None] = mapped_column(String(128), unique=True)
    url: Mapped[str] = mapped_column(String(2048))
    # Its body (``WebhookBody``), shared with the event's other endpoints: NULL once the
    # task has expired.
    body_id: Mapped[uuid.UUID | None] = mapped_column(
        UUID(as_uuid=True), ForeignKey("webhook_bodies.id", ondelete="SET NULL")
    )
    body_expires_at: Mapped[datetime] = mapped_column(TZ)
    trace_id: Mapped[str] = mapped_column(String(32))
    status: Mapped[str] = mapped_column(String(16))
    attempts: Mapped[int] = mapped_column(Integer, server_default=text("0"))
    # A retryable failure on this attempt makes the message dead.
    final_attempt: Mapped[int] = mapped_column(Integer)
    next_attempt_at: Mapped[datetime] = mapped_column(TZ)
    # While an attempt is under way; past it, the attempt is taken as lost.
    lease_until: Mapped[datetime | None] = mapped_column(TZ)
    last_status_code: Mapped[int | None] = mapped_column(Integer)
    last_error: Mapped[str | None] = mapped_column(Text)
    created_at: Mapped[datetime] = mapped_column(TZ, server_default=func.now())
    finished_at: Mapped[datetime | None] = mapped_column(TZ)
    expires_at: Mapped[datetime] = mapped_column(TZ)

    __table_args__ = (
        CheckConstraint(
            "status IN ('pending', 'sending', 'succeeded', 'failed', 'dead')", name="status"
        ),
        Index("ix_webhook_deliveries_webhook_id_id", "webhook_id", "id"),
        Index("ix_webhook_deliveries_tenant_task_id", "tenant", "task_id"),
        # The sweeper looks for due or stuck deliveries whose message was lost.
        Index("ix_webhook_deliveries_status_next_attempt_at", "status", "next_attempt_at"),
        # The lost ones, a share a tenant (``upkeep.stranded``): one probe finds each tenant.
        Index(
            "ix_webhook_deliveries_pending_tenant_next_attempt_at",
            "tenant",
            "next_attempt_at",
            postgresql_where=text("status = 'pending'"),
        ),
        Index("ix_webhook_deliveries_expires_at", "expires_at"),
        Index(
            "ix_webhook_deliveries_body_expires_at",
            "body_expires_at",
            postgresql_where=text("body_id IS NOT NULL"),
        ),
        # A body's removal finds the deliveries that name it (ON DELETE SET NULL).
        Index(
            "ix_webhook_deliveries_body_id",
            "body_id",
            postgresql_where=text("body_id IS NOT NULL"),
        ),
        # A tenant's attempts in flight are counted at every claim.
        Index(
            "ix_webhook_deliveries_tenant_sending",
            "tenant",
            postgresql_where=text("status = 'sending'"),
        ),
        # ... and its releases on their way at every release: the few marked, not its backlog.
        Index(
            "ix_webhook_deliveries_released_tenant_lease_until",
            "tenant",
            "lease_until",
            postgresql_where=text("status = 'pending' AND lease_until IS NOT NULL"),
        ),
    )


class WebhookOutbox(Base):
    """A task's final event whose fanout is owed (``broker.webhooks.outbox``): written by the
    task's final write when anyone may want the event, removed by the fanout. Only those in
    flight, so it stays small whatever the number of tasks."""

    __tablename__ = "webhook_outbox"

    # No foreign key: its check would cost each final write a second probe of the task's
    # row. The sweep removes a record whose task is gone.
    task_id: Mapped[uuid.UUID] = mapped_column(UUID(as_uuid=True), primary_key=True)
    finished_at: Mapped[datetime] = mapped_column(TZ)
    # The sweep's runs of the fanout that failed, and when it may run it again (NULL: it has
    # not failed); the sweep gives it up after the deliveries' number of attempts.
    failures: Mapped[int] = mapped_column(SmallInteger, server_default=text("0"))
    retry_at: Mapped[datetime | None] = mapped_column(TZ)

    __table_args__ = (
        # The sweep takes the fanouts owed oldest first, and those to try again by when they
        # are due: each from an index of its own, so neither walks past the other's rows.
        Index(
            "ix_webhook_outbox_finished_at",
            "finished_at",
            postgresql_where=text("retry_at IS NULL"),
        ),
        Index(
            "ix_webhook_outbox_retry_at",
            "retry_at",
            postgresql_where=text("retry_at IS NOT NULL"),
        ),
    )


class WebhookAttempt(Base):
    """One HTTP attempt of a delivery, as the sender saw it."""

    __tablename__ = "webhook_attempts"

    delivery_id: Mapped[uuid.UUID] = mapped_column(
        UUID(as_uuid=True),
        ForeignKey("webhook_deliveries.id", ondelete="CASCADE"),
        primary_key=True,
    )
    attempt: Mapped[int] = mapped_column(Integer, primary_key=True)
    at: Mapped[datetime] = mapped_column(TZ)
    status_code: Mapped[int | None] = mapped_column(Integer)
    error: Mapped[str | None] = mapped_column(Text)
    latency_ms: Mapped[int] = mapped_column(Integer)
    # The address actually connected to, for the audit trail of the SSRF guard.
    address: Mapped[str | None] = mapped_column(String(64))
    response_excerpt: Mapped[str | None] = mapped_column(Text)


# Core handles for the hot paths, which use SQL expressions rather than ORM objects.
tasks_table = cast(Table, Task.__table__)
tenant_usage_table = cast(Table, TenantUsage.__table__)
agent_cards_table = cast(Table, AgentCard.__table__)
agent_instances_table = cast(Table, AgentInstance.__table__)
remote_agents_table = cast(Table, RemoteAgent.__table__)
agent_channels_table = cast(Table, AgentChannel.__table__)
agent_revocations_table = cast(Table, AgentRevocation.__table__)
sessions_table = cast(Table, Session.__table__)
session_revisions_table = cast(Table, SessionRevision.__table__)
api_keys_table = cast(Table, ApiKey.__table__)
webhooks_table = cast(Table, Webhook.__table__)
callback_secrets_table = cast(Table, CallbackSecret.__table__)
webhook_deliveries_table = cast(Table, WebhookDelivery.__table__)
webhook_bodies_table = cast(Table, WebhookBody.__table__)
webhook_attempts_table = cast(Table, WebhookAttempt.__table__)
webhook_outbox_table = cast(Table, WebhookOutbox.__table__)


def in_sources(move: Move) -> ColumnElement[bool]:
    """The guard of a status write: the task row is in one of ``move``'s sources. Equalities,
    not IN: an IN list is rendered again on every execution of a statement built once."""
    return or_(*(tasks_table.c.status == status for status in move.sources))


# What a final write reads back: every column of ``tasks`` but the payload (see ``TaskRow``).
FINAL_COLUMNS = tuple(column for column in tasks_table.c if column.key != "payload")


def as_task_row(row: Row[Any]) -> TaskRow:
    """A ``tasks`` row as the type the modules pass around."""
    return cast(TaskRow, dict(row._mapping))
