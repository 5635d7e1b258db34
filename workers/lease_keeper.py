"""The worker's lease: advertised at start, renewed every TTL/3 by a thread of its own (never
from the task path, so an idle worker stays live), written again at once when that thread
finds it gone from Redis (a FLUSHDB, a Redis back after longer than the TTL), and given up on
drain or shutdown.

The renewal waits on nothing but Redis. Everything else the keeper does each interval runs on
a second thread (``upkeep``): drain requests, readiness, the instance's row in Postgres and
the orphan check. When one thread did it all, a readiness callable that hung held it: the
lease expired while the worker went on taking tasks, and the reaper took back each one it ran.

Upkeep applies readiness: a capability whose readiness check says no, raises or does not
answer in time (``workers.readiness``), or that an agent marked not ready through the SDK,
is removed from routing and its queues stop being consumed until it is ready again; the
worker itself stays up and keeps its lease, so the tasks it is running are not taken back.

A revoked version is dropped for good: the renewal leaves its card out (``leases.renew``), and
the keeper then stops serving that capability. Revocations in Postgres are read at start too,
so a worker of a revoked version started after Redis lost the set serves nothing of it.

Each card has three queues: the capability's, the card's and this instance's own (hints); a
card naming ``tenants`` does not take from the capability's (``CardRef.queues``), whatever
``-Q`` says. On drain the tasks waiting in the instance's queues move to their cards' queues.

One name, one process (``NameRoll``): Celery names a worker ``celery@<host>`` unless ``-n``
says otherwise, so two workers started on one host without it share a name, its lease and
the tasks claimed under it. Each process stamps itself in the name's roll at each renewal.
While another is alive under the name, no process of it recovers orphans (each would take the
other's running tasks for lost), only the one that started first writes the lease (each
overwrote the other's cards, so routing lost the first's capabilities), the others keep that
lease from expiring (it covers their tasks too), and each logs an error naming ``-n``.
"""

from __future__ import annotations

import logging
import os
import socket
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import replace
from typing import Any

import redis
from celery import bootsteps
from sqlalchemy import Engine

from broker import redisclients
from broker.db.engines import sync_engine
from broker.observability import metrics
from broker.registry import leases, revocations
from broker.registry.model import (
    DRAINING,
    OFFLINE,
    QUEUE_NAME_MAX_BYTES,
    READY,
    Lease,
    drain_key,
    lease_key,
    now_s,
)
from broker.settings import Settings
from broker.tasks import execution
from broker.tasks.dispatch import send_run
from workers.readiness import ReadinessChecks
from workers.sdk.agent import AgentRegistry, CapabilitySpec

log = logging.getLogger("reach.lease")
OrphanHandler = Callable[[list[dict[str, Any]]], object]
# Per instance name: each process running under it, and until when it said it lives.
PROCESSES_PREFIX = "reach:instance:processes:"
ROLL_KEPT_S = 3600  # a name's roll, after its last stamp (its entries' own times decide)
LEASE_CHECK_S = 1.0  # how often the renewal thread looks for its lease in Redis


class LeaseKeeper:
    def __init__(
        self,
        consumer: Any,
        settings: Settings,
        registry: AgentRegistry,
        on_orphans: OrphanHandler | None = None,
    ) -> None:
        self.consumer = consumer
        self.on_orphans = on_orphans
        self.instance: str = consumer.hostname
        consumed = set(consumer.app.amqp.queues.consume_from or {})
        self.specs = [s for s in registry if s.name in consumed]
        ttl = settings.lease_ttl_s or min((s.card.lease_ttl_s for s in self.specs), default=30.0)
        self.redis = redisclients.sync_client(settings.redis_url, socket_timeout=5)
        self.engine = sync_engine(settings, pool_size=1)
        self.lease = Lease(
            instance=self.instance,
            state=READY,
            heartbeat_at=now_s(),
            started_at=now_s(),
            lease_ttl_s=ttl,
            hostname=socket.gethostname(),
            pid=os.getpid(),
            cards=tuple(s.card.ref() for s in self.specs),
        )
        self.roll = NameRoll(self.redis, self.lease)
        # Whether another process runs under this name, and whether this one holds the
        # name's lease (it started first), as of the last renewal.
        self.shared = False
        self.first = True
        # Each round of upkeep waits a renewal interval at most for the checks it starts; a
        # check still running past the TTL counts as not ready, a slower answer still counts.
        self.readiness = ReadinessChecks(
            wait_s=self.lease.renew_every_s, hang_s=self.lease.lease_ttl_s
        )
        # The lease and the specs change on the renewal's thread, upkeep's, and the
        # consumer's (drain, shutdown); the lock is never held while agent code runs.
        self._lock = threading.RLock()
        self._stop = threading.Event()
        self._renewals = threading.Thread(target=self._renew_each, name="reach-lease", daemon=True)
        self._upkeep = threading.Thread(target=self._tick_each, name="reach-upkeep", daemon=True)
        self.started = False

    def start(self) -> None:
        if not self.specs:
            return
        self._check_queue_names()
        self.started = True
        leases.advertise_cards(self.engine, [s.card.document() for s in self.specs])
        self.redis.delete(drain_key(self.instance))  # a restart is not still draining
        versions = [(s.card.agent_id, s.card.version) for s in self.specs]
        revoked = revocations.revoked_among(self.engine, versions)
        for spec in [s for s in self.specs if (s.card.agent_id, s.card.version) in revoked]:
            log.warning("%s: %s %s is revoked", self.instance, spec.card.agent_id, spec.name)
            self.consumer.cancel_task_queue(spec.name)
            self._drop(spec)
        for spec in self.specs:  # so routing can pick this card, or this instance (a hint)
            queues = spec.card.ref().queues(self.instance)
            if spec.name not in queues:  # a private card: any tenant's tasks wait in -Q's
                self.consumer.cancel_task_queue(spec.name)
            for queue in queues:
                if queue != spec.name:
                    self._consume_from_start(queue)
        self.renew()
        self._record(READY)
        self._renewals.start()
        self._upkeep.start()
        log.info(
            "lease held by %s for %s (ttl %.1fs)",
            self.instance,
            [s.name for s in self.specs],
            self.lease.lease_ttl_s,
        )

    def _check_queue_names(self) -> None:
        """Refuse to start, saying why, when the broker is RabbitMQ and a queue of this
        instance's is past the 255 bytes of an AMQP queue's name: its declare failed with
        ``ubyte format requires 0 <= number <= 255``, which named neither queue nor cure."""
        if self.consumer.connection.transport.driver_type != "amqp":
            return
        for spec in self.specs:
            for queue in spec.card.ref().queues(self.instance):
                if len(queue.encode()) > QUEUE_NAME_MAX_BYTES:
                    raise RuntimeError(
                        f"the queue {queue!r} is {len(queue.encode())} bytes, past the "
                        f"{QUEUE_NAME_MAX_BYTES} RabbitMQ allows a queue's name: give the "
                        "worker a shorter name (-n) or the capability a shorter one"
                    )

    def _consume_from_start(self, name: str) -> None:
        """Add ``name`` to the queues the task consumer takes from, for Celery's loop to start
        with ``-Q``'s once its message callback is set. Starting it here (``add_task_queue``)
        started every queue not yet consumed, ``-Q``'s too, before there was a callback: over
        AMQP the messages already waiting arrived while ``basic_consume`` waited for its reply,
        and the worker died at start. The keeper starts before that loop (``LeaseStep``), and
        the queue stays selected, so a consumer restarted after a lost connection takes it too.
        """
        tasks = self.consumer.task_consumer
        if tasks.consuming_from(name):
            return
        queues = self.consumer.app.amqp.queues
        # Declared as Celery's ``add_task_queue`` declares it: the binding its publishers use.
        if name in queues:
            queue = queues.select_add(queues[name])
        else:
            queue = queues.select_add(name, exchange=name, exchange_type="direct")
        tasks.add_queue(queue)

    def _renew_each(self) -> None:
        """Renew every ``renew_every_s``, and at once when the lease is found gone from Redis
        (checked each ``LEASE_CHECK_S``): Redis that lost its data, or came back after
        longer than the TTL, would otherwise route nothing here until the next renewal."""
        due = time.monotonic() + self.lease.renew_every_s
        while not self._stop.wait(min(LEASE_CHECK_S, self.lease.renew_every_s)):
            if time.monotonic() < due and not self._lease_missing():
                continue
            due = time.monotonic() + self.lease.renew_every_s
            try:
                self.renew()
            except Exception:  # a missed renewal is survivable; the next one may succeed
                metrics.heartbeat_failures.inc()
                log.exception("lease renewal failed for %s", self.instance)

    def _lease_missing(self) -> bool:
        """Whether the lease this process writes is gone from Redis (False when Redis does
        not answer: the due renewal tries, and reports it)."""
        if not self.first or self.lease.state == OFFLINE:
            return False
        return lease_missing(self.redis, self.instance)

    def _tick_each(self) -> None:
        while not self._stop.wait(self.lease.renew_every_s):
            try:
                self.tick()
            except Exception:  # the next tick reads everything again
                log.exception("lease upkeep failed for %s", self.instance)

    def tick(self) -> None:
        """Upkeep: a drain request, readiness, the instance's row, orphans."""
        try:
            self._steer()
        finally:
            # Written while Redis does not answer too: the reaper takes a worker whose lease
            # is gone for dead only once this row is a TTL old (``recovery.seen_live``).
            if self.lease.state != OFFLINE:
                self._record(self.lease.state)
        if self.lease.state != OFFLINE:
            self._find_orphans()

    def _steer(self) -> None:
        """A drain request, the end of a drain, readiness: each read from Redis."""
        if self.lease.state == READY and leases.drain_requested(self.redis, self.instance):
            self.begin_drain()
        if self.lease.state == DRAINING:
            if self._holding() == 0:
                self.go_offline()
        else:
            self._apply_readiness()

    def _find_orphans(self) -> None:
        """Tasks this instance claimed that none of its pool processes is running any more:
        the process died (kill -9, OOM) while the worker lives on, so no lease expires. Not
        while another process runs under the name: its tasks are not ours to hold. The roll
        is read here, after the renewal's: a process stamps itself before it takes a task,
        and a task is looked at only once it is two renewals old."""
        if self.on_orphans is None or self.roll.others(now_s()):
            return
        found = orphans(
            self.engine, self.consumer, self.instance, started_before_s=2 * self.lease.renew_every_s
        )
        if found:
            self.on_orphans(found)

    def renew(self) -> None:
        """Stamp this process in its name's roll and, if it holds the name's lease, write
        it. Redis only: nothing here waits on agent code or on Postgres."""
        with self._lock:
            if self.lease.state == OFFLINE:
                return
            self.lease = replace(self.lease, heartbeat_at=now_s(), active=self._holding())
            self._read_roll(self.roll.stamp(self.lease))
            if not self.first:
                self._extend_first_lease()
                return
            written = leases.renew(self.redis, self.lease)
            revoked = [
                (spec, card)
                for spec, card in zip(self.specs, self.lease.cards, strict=True)
                if card not in written.cards
            ]
            for spec, card in revoked:
                log.warning("%s: %s %s is revoked", self.instance, card.agent_id, card.version)
                if card.ready and self.lease.state == READY:
                    self._toggle_queues(spec, consume=False)
                self._drop(spec)

    def _read_roll(self, others: list[str]) -> None:
        first = self.roll.first_among(others)
        if others and (not self.shared or first != self.first):
            log.error(
                "%s is the name of %d other worker process(es) (%s), alive or stopped less than"
                " a lease TTL ago without giving it up: start each worker with a name of its"
                " own (-n <name>@%%h). Meanwhile no orphaned task is recovered here, and %s",
                self.instance,
                len(others),
                ", ".join(others),
                "this process holds the name's lease: the others' capabilities are not routed"
                if first
                else "this process's capabilities are not routed (the first one's lease holds"
                " the name)",
            )
        elif not others and self.shared:
            log.info("%s: no other process runs under this name any more", self.instance)
        self.shared, self.first = bool(others), first

    def _extend_first_lease(self) -> None:
        """Keep the name's lease (the first process's) alive by its own TTL, never shorter:
        it covers this process's running tasks too, should the first stop without giving it
        up (kill -9), until this one takes the name over at a renewal."""
        key = lease_key(self.instance)
        raw = self.redis.get(key)
        if raw is not None:
            self.redis.pexpire(key, int(1000 * Lease.from_json(raw).lease_ttl_s))

    def _drop(self, spec: CapabilitySpec) -> None:
        """Stop serving ``spec`` for good (its version is revoked)."""
        with self._lock:
            at = self.specs.index(spec)
            self.specs.pop(at)
            cards = list(self.lease.cards)
            cards.pop(at)
            self.lease = replace(self.lease, cards=tuple(cards))

    def _apply_readiness(self) -> None:
        """Check readiness off the lock (agent code, bounded by ``ReadinessChecks``), then
        apply what changed and publish it at once."""
        specs = list(self.specs)
        flagged = leases.not_ready_flags(self.redis, self.instance, [s.name for s in specs])
        ready = self.readiness.run(s for s in specs if s.name not in flagged)
        paused: list[CapabilitySpec] = []
        with self._lock:
            if self.lease.state != READY:
                return
            changed = False
            cards = []
            for spec, card in zip(self.specs, self.lease.cards, strict=True):
                now_ready = ready.get(spec.name, False)
                if now_ready != card.ready:
                    self._toggle_queues(spec, consume=now_ready)
                    changed = True
                    if not now_ready:
                        paused.append(spec)
                cards.append(replace(card, ready=now_ready))
            self.lease = replace(self.lease, cards=tuple(cards))
            if changed:
                self.renew()
        # What was hinted here waits for any instance of its card, not for this one's
        # readiness to come back (an hour, a dependency down): routing sends no new hint here.
        self._rehome_hinted(paused)

    def _toggle_queues(self, spec: CapabilitySpec, *, consume: bool) -> None:
        log.info("%s: %s %s", self.instance, "resuming" if consume else "pausing", spec.name)
        for queue in spec.card.ref().queues(self.instance):
            action = self.consumer.add_task_queue if consume else self.consumer.cancel_task_queue
            # call_soon runs it on the consumer's own loop: its queues are not thread-safe.
            self.consumer.call_soon(action, queue)

    def _record(self, state: str) -> None:
        """The instance's row in Postgres: the first process of the name writes it."""
        if self.first:
            leases.record_instance(self.engine, self.lease, state)

    def begin_drain(self, *, stop_consuming: bool = True) -> None:
        """Stop taking work: leave routing, stop consuming, finish what is held.
        On warm shutdown Celery stops consuming itself (``stop_consuming=False``)."""
        with self._lock:
            if self.lease.state in (DRAINING, OFFLINE) or not self.started:
                return
            log.info("%s: draining", self.instance)
            self.lease = replace(self.lease, state=DRAINING)
            if self.first:
                leases.withdraw(self.redis, self.lease)
            for spec, card in zip(self.specs, self.lease.cards, strict=True):
                if stop_consuming and card.ready:
                    self._toggle_queues(spec, consume=False)
            self.renew()
        self._record(DRAINING)
        self._rehome_hinted(list(self.specs))

    def _rehome_hinted(self, specs: list[CapabilitySpec]) -> None:
        """Tasks hinted to this instance for ``specs`` that it will not take now wait in
        their cards' queues (their messages left here find them gone, or claim them once)."""
        for spec in specs:
            ref = spec.card.ref()
            own = ref.instance_queue(self.instance)
            # Where the tenant's fair slice of the queue puts each, as every message published
            # again goes (``workers.application``): at the front, one tenant's hinted backlog
            # moved on a drain went before every other tenant's later submits.
            republish = getattr(self.consumer.app, "reach_republish", None)
            for row in execution.rehome(self.engine, own, ref.queue()):
                trace_id, deadline_at, tenant = row["trace_id"], row["deadline_at"], row["tenant"]
                if republish is not None:
                    republish(row["id"], ref.queue(), trace_id, deadline_at, 0.0, tenant)
                    continue
                send_run(
                    self.consumer.app,
                    row["id"],
                    ref.queue(),
                    trace_id=trace_id,
                    tenant=tenant,
                    deadline_at=deadline_at,
                )

    def go_offline(self) -> None:
        """Give up the lease. A process that shares its name leaves the name's lease to the
        others: the first one's cards leave routing, and the next renewal of another process
        writes the lease as its own."""
        with self._lock:
            if not self.started or self.lease.state == OFFLINE:
                return
            self._stop.set()
            self.lease = replace(self.lease, state=OFFLINE)
            alone = not self.roll.leave(now_s())
            if alone:
                leases.release(self.redis, self.lease)
            elif self.first:
                leases.withdraw(self.redis, self.lease)
        if alone:
            leases.record_instance(self.engine, self.lease, OFFLINE)
        self._rehome_hinted(list(self.specs))  # any routed here while the drain began
        log.info("%s: offline", self.instance)

    def _holding(self) -> int:
        from celery.worker import state

        return len(held(self.consumer)) + len(state.reserved_requests)


class NameRoll:
    """The processes running under one instance name, in Redis: each stamps its own entry
    (``<host>:<pid>:<started_at>``) with the time its lease would expire, and reads the
    others'. One whose time has passed is gone: stopped for good, or the one before a restart
    after kill -9 (a restart within the TTL finds it still there, and waits it out)."""

    def __init__(self, client: redis.Redis, lease: Lease) -> None:
        self.client = client
        self.key = PROCESSES_PREFIX + lease.instance
        self.me = f"{lease.hostname}:{lease.pid}:{lease.started_at}"

    def stamp(self, lease: Lease) -> list[str]:
        """Say this process lives until ``lease`` would expire; the others alive."""
        with self.client.pipeline(transaction=True) as pipe:
            pipe.hset(self.key, self.me, lease.heartbeat_at + lease.lease_ttl_s)
            pipe.expire(self.key, ROLL_KEPT_S)
            pipe.hgetall(self.key)
            roll = pipe.execute()[2]
        return self._alive(roll, lease.heartbeat_at)

    def others(self, now: float) -> list[str]:
        """The other processes alive under the name."""
        return self._alive(self.client.hgetall(self.key), now)

    def leave(self, now: float) -> list[str]:
        """Take this process off the roll; the others alive."""
        self.client.hdel(self.key, self.me)
        return self.others(now)

    def first_among(self, others: list[str]) -> bool:
        """Whether this process started before every other (the entry breaks a tie)."""
        return all((_started_at(self.me), self.me) < (_started_at(o), o) for o in others)

    def _alive(self, roll: Mapping[bytes | str, bytes | str], now: float) -> list[str]:
        until = {_text(entry): float(at) for entry, at in roll.items()}
        gone = [entry for entry, at in until.items() if at < now]
        if gone:
            self.client.hdel(self.key, *gone)
        return sorted(entry for entry in until if entry not in gone and entry != self.me)


def _text(entry: bytes | str) -> str:
    return entry.decode() if isinstance(entry, bytes) else entry


def _started_at(entry: str) -> float:
    return float(entry.rsplit(":", 1)[1])


def lease_missing(client: redis.Redis, instance: str) -> bool:
    """Whether ``instance``'s lease is gone from Redis (False when Redis does not answer:
    the next renewal tries, and reports it); logged, as it is written again."""
    try:
        missing = not client.exists(lease_key(instance))
    except redis.RedisError:
        return False
    if missing:
        log.warning("%s: the lease is gone from Redis; writing it again", instance)
    return missing


def held(consumer: Any) -> set[str]:
    """The ids of the tasks this worker process is running: Celery's requests, and the runs
    the pool holds without one (``workers.pool``)."""
    from celery.worker import state

    direct = getattr(consumer.app, "reach_direct", None)
    return {request.id for request in list(state.active_requests)} | (
        direct.held() if direct is not None else set()
    )


def orphans(
    engine: Engine, consumer: Any, instance: str, *, started_before_s: float
) -> list[dict[str, Any]]:
    """The tasks running under ``instance`` (claimed at least ``started_before_s`` ago) that
    this process does not hold: its run ended without a final write, or the pool process
    running it died, while the worker lives on, so no lease expires for them."""
    running = execution.running_tasks(engine, instance=instance, started_before_s=started_before_s)
    holding = held(consumer)
    return [row for row in running if str(row["id"]) not in holding]


def lease_step(
    settings: Settings, registry: AgentRegistry, on_orphans: OrphanHandler | None = None
) -> type[bootsteps.StartStopStep]:
    """A consumer bootstep holding the lease for as long as the consumer runs."""

    class LeaseStep(bootsteps.StartStopStep):  # type: ignore[misc]
        requires = ("celery.worker.consumer.tasks:Tasks",)

        def __init__(self, consumer: Any, **kwargs: Any) -> None:
            super().__init__(consumer, **kwargs)
            self.keeper: LeaseKeeper | None = None

        def start(self, consumer: Any) -> None:
            if self.keeper is None:
                self.keeper = LeaseKeeper(consumer, settings, registry, on_orphans)
                consumer.app.reach_lease_keeper = self.keeper
                self.keeper.start()

        def shutdown(self, consumer: Any) -> None:
            if self.keeper is not None:
                self.keeper.go_offline()

    return LeaseStep
