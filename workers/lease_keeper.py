"""The worker's lease: advertised at start, renewed every TTL/3 by a thread of its own (never
from the task path, so an idle worker stays live), and given up on drain or shutdown.

Each renewal also applies readiness: a capability whose readiness callable says no, or that an
agent marked not ready through the SDK, is removed from routing and its queues stop being
consumed until it is ready again; the worker itself stays up.

A revoked version is dropped for good: the renewal leaves its card out (``leases.renew``), and
the keeper then stops serving that capability. Revocations in Postgres are read at start too,
so a worker of a revoked version started after Redis lost the set serves nothing of it.

Each card has three queues: the capability's, the card's, and this instance's own (hints); a
card naming ``tenants`` does not take from the capability's (``CardRef.queues``), whatever
``-Q`` says. On drain the tasks waiting in the instance's queues move to their cards' queues.
"""

from __future__ import annotations

import logging
import os
import socket
import threading
from collections.abc import Callable
from dataclasses import replace
from typing import Any

from celery import bootsteps
from sqlalchemy import Engine

from broker import redisclients
from broker.db.engines import sync_engine
from broker.observability import metrics
from broker.registry import leases, revocations
from broker.registry.model import (
    DRAINING,
    OFFLINE,
    READY,
    Lease,
    drain_key,
    now_s,
)
from broker.settings import Settings
from broker.tasks import execution
from broker.tasks.dispatch import send_run
from workers.sdk.agent import AgentRegistry, CapabilitySpec

log = logging.getLogger("reach.lease")
OrphanHandler = Callable[[list[dict[str, Any]]], object]


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
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="reach-lease", daemon=True)
        self.started = False

    def start(self) -> None:
        if not self.specs:
            return
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
                    self.consumer.add_task_queue(queue)
        self.renew()
        leases.record_instance(self.engine, self.lease, READY)
        self._thread.start()
        log.info(
            "lease held by %s for %s (ttl %.1fs)",
            self.instance,
            [s.name for s in self.specs],
            self.lease.lease_ttl_s,
        )

    def _run(self) -> None:
        while not self._stop.wait(self.lease.renew_every_s):
            try:
                self.tick()
            except Exception:  # a missed renewal is survivable; the next one may succeed
                metrics.heartbeat_failures.inc()
                log.exception("lease renewal failed for %s", self.instance)

    def tick(self) -> None:
        if self.lease.state == READY and leases.drain_requested(self.redis, self.instance):
            self.begin_drain()
        if self.lease.state == DRAINING:
            if self._holding() == 0:
                self.go_offline()
                self._stop.set()
                return
        else:
            self._apply_readiness()
        self.renew()
        leases.record_instance(self.engine, self.lease, self.lease.state)
        self._find_orphans()

    def _find_orphans(self) -> None:
        """Tasks this instance claimed that none of its pool processes is running any more:
        the process died (kill -9, OOM) while the worker lives on, so no lease expires."""
        if self.on_orphans is None:
            return
        found = orphans(
            self.engine, self.consumer, self.instance, started_before_s=2 * self.lease.renew_every_s
        )
        if found:
            self.on_orphans(found)

    def renew(self) -> None:
        self.lease = replace(self.lease, heartbeat_at=now_s(), active=self._holding())
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

    def _drop(self, spec: CapabilitySpec) -> None:
        """Stop serving ``spec`` for good (its version is revoked)."""
        at = self.specs.index(spec)
        self.specs.pop(at)
        cards = list(self.lease.cards)
        cards.pop(at)
        self.lease = replace(self.lease, cards=tuple(cards))

    def _apply_readiness(self) -> None:
        flagged = leases.not_ready_flags(self.redis, self.instance, [s.name for s in self.specs])
        cards = []
        for spec, card in zip(self.specs, self.lease.cards, strict=True):
            ready = spec.name not in flagged and _ready(spec)
            if ready != card.ready:
                self._toggle_queues(spec, consume=ready)
            cards.append(replace(card, ready=ready))
        self.lease = replace(self.lease, cards=tuple(cards))

    def _toggle_queues(self, spec: CapabilitySpec, *, consume: bool) -> None:
        log.info("%s: %s %s", self.instance, "resuming" if consume else "pausing", spec.name)
        for queue in spec.card.ref().queues(self.instance):
            action = self.consumer.add_task_queue if consume else self.consumer.cancel_task_queue
            # call_soon runs it on the consumer's own loop: its queues are not thread-safe.
            self.consumer.call_soon(action, queue)

    def begin_drain(self, *, stop_consuming: bool = True) -> None:
        """Stop taking work: leave routing, stop consuming, finish what is held.
        On warm shutdown Celery stops consuming itself (``stop_consuming=False``)."""
        if self.lease.state in (DRAINING, OFFLINE) or not self.started:
            return
        log.info("%s: draining", self.instance)
        self.lease = replace(self.lease, state=DRAINING)
        leases.withdraw(self.redis, self.lease)
        for spec, card in zip(self.specs, self.lease.cards, strict=True):
            if stop_consuming and card.ready:
                self._toggle_queues(spec, consume=False)
        self.renew()
        leases.record_instance(self.engine, self.lease, DRAINING)
        self._rehome_hinted()

    def _rehome_hinted(self) -> None:
        """Tasks hinted to this instance that it will not take now wait in their cards'
        queues (their messages left here find them gone, or claim them once)."""
        for spec in self.specs:
            ref = spec.card.ref()
            own = ref.instance_queue(self.instance)
            for row in execution.rehome(self.engine, own, ref.queue()):
                send_run(
                    self.consumer.app,
                    row["id"],
                    ref.queue(),
                    trace_id=row["trace_id"],
                    deadline_at=row["deadline_at"],
                )

    def go_offline(self) -> None:
        if not self.started or self.lease.state == OFFLINE:
            return
        self._stop.set()
        self.lease = replace(self.lease, state=OFFLINE)
        leases.release(self.redis, self.lease)
        leases.record_instance(self.engine, self.lease, OFFLINE)
        self._rehome_hinted()  # any routed here while the drain began
        log.info("%s: offline", self.instance)

    def _holding(self) -> int:
        from celery.worker import state

        return len(held(self.consumer)) + len(state.reserved_requests)


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


def _ready(spec: CapabilitySpec) -> bool:
    if spec.readiness is None:
        return True
    try:
        return bool(spec.readiness())
    except Exception:
        log.exception("readiness check of %s raised; treating it as not ready", spec.name)
        return False


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
