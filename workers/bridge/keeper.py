"""The bridge's keeper: registrations, health checks, leases and queues of remote agents.

Every ``remote_health_interval_s`` a thread of its own (never the task path), and at once
when an agent is registered or removed (``REGISTRATIONS_KEY`` moved, looked at every
``NUDGE_POLL_S``):

- reads the registrations, so a new agent is served and a removed one dropped without a
  restart;
- checks every agent's health at once (``workers.bridge.health_checks``), each check, body
  included, within ``remote_health_timeout_s``, and the round too: one agent's slow answer
  never delays or fails another's check. In the seeds' bug 5.1, slow pings took the worker's
  threads and real calls timed out at random; here no check ever runs where a task's call
  runs;
- dampens what it saw (``broker.remote.health``), and while the agent counts as up renews its
  lease and consumes its queues; once it does not, gives up both, so routing answers 503
  ``no_agent_available`` at once and queued tasks wait for it;
- reads the revoked versions: a revoked agent's cards leave its lease and its queues are no
  longer consumed (the renewal itself drops them too, ``leases.renew``);
- renews the bridge's own lease and writes its own row in Postgres (``agent_instances``),
  the row whether or not Redis answers: the reaper takes an instance whose lease is gone for
  dead only once that row is a TTL old (``recovery.seen_live``), so Redis that lost its data
  takes no live bridge's calls for lost. A thread of its own looks for that lease every
  ``LEASE_CHECK_S`` and writes it again at once when it is gone. It also recovers the tasks
  claimed under its name that it no longer holds (``lease_keeper.orphans``): a call whose
  final write failed past its retries (Postgres away), while the bridge lives on, left its
  task running. Only while this process is the only one alive under that name (``_alone``):
  two bridges started with the same ``-n`` would take each other's calls for orphans, so
  then the check waits (with a warning). Once a process of the name is gone for good (a
  restart after kill -9), its calls are recovered here after the lease's TTL.
"""

from __future__ import annotations

import logging
import os
import socket
import threading
import time
from dataclasses import dataclass, field, replace
from typing import Any

from celery import bootsteps

from broker import redisclients
from broker.db.engines import sync_engine
from broker.registry import leases, revocations
from broker.registry.model import OFFLINE, READY, REGISTRATIONS_KEY, SUSPECT, Lease, now_s
from broker.remote.health import Dampening, Health
from broker.remote.registration import A2A, HTTP, RemoteAgent, load_all, remote_instance
from broker.settings import Settings
from broker.webhooks.ssrf import Guard
from workers.bridge.health_checks import HealthChecks
from workers.bridge.registry import RemoteRegistry
from workers.lease_keeper import LEASE_CHECK_S, OrphanHandler, lease_missing, orphans

log = logging.getLogger("reach.bridge")
# Per bridge name: each process running under it, and when it last said so.
PROCESSES_PREFIX = "reach:bridge:processes:"
# How often, between ticks, the count of registrations is looked at (one GET).
NUDGE_POLL_S = 0.5


@dataclass
class Watched:
    agent: RemoteAgent
    health: Health = field(default_factory=Health)
    state: str = ""  # last recorded for the read side
    # When this process last renewed the agent's lease (monotonic); None while it holds none.
    renewed_at: float | None = None


class RemoteKeeper:
    def __init__(
        self,
        consumer: Any,
        settings: Settings,
        registry: RemoteRegistry,
        on_orphans: OrphanHandler | None = None,
    ) -> None:
        self.consumer = consumer
        self.on_orphans = on_orphans
        # Whether this process alone renewed its name's lease since its last tick.
        self.alone = False
        self.settings = settings
        self.registry = registry
        self.engine = sync_engine(settings, pool_size=1, max_overflow=1)
        self.redis = redisclients.sync_client(settings.redis_url, socket_timeout=5)
        self.guard = Guard(allow=settings.agent_networks)
        self.policy = Dampening(
            fail_after=settings.remote_fail_after,
            recover_passes=settings.remote_recover_passes,
            recover_after_s=settings.remote_recover_after_s,
        )
        self.checks = HealthChecks(
            self.guard, settings.remote_health_timeout_s, settings.remote_health_threads
        )
        self.watched: dict[str, Watched] = {}
        self.revoked: set[tuple[str, str]] = set()
        self.consumed: set[str] = set()
        self.started_at = now_s()
        self.own = self._own_lease()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="reach-bridge", daemon=True)
        self._watch = threading.Thread(
            target=self._rewrite_each, name="reach-bridge-lease", daemon=True
        )

    def start(self) -> None:
        self._thread.start()
        self._watch.start()

    def stop(self) -> None:
        """Stop, and say so as a worker does (``LeaseKeeper.go_offline``): the bridge's own
        row ``offline``, its lease given up. Called once the worker has stopped, its calls in
        flight ended. A process that shares its name leaves both to the others. The agents'
        leases are left to their TTL: another bridge may serve them."""
        self._stop.set()
        self.checks.close()
        # A tick in progress would write the row ready again after it.
        self._thread.join(self.settings.remote_health_timeout_s + 5)
        self._watch.join(LEASE_CHECK_S + 1)
        offline = replace(self.own, state=OFFLINE, heartbeat_at=now_s())
        try:
            if not self._leave_roll(offline):
                return
            leases.release(self.redis, offline)
        except Exception:  # Redis away: the lease goes at its TTL, the row is written below
            log.exception("giving up %s's lease failed", offline.instance)
        try:
            leases.record_instance(self.engine, offline, OFFLINE)
        except Exception:  # Postgres away: the row ages out; the worker's stop goes on
            log.exception("marking %s offline failed", offline.instance)
            return
        log.info("%s: offline", offline.instance)

    def _run(self) -> None:
        while not self._stop.is_set():
            seen = self._registrations()
            try:
                self.tick()
            except Exception:  # survivable: the next tick reads everything again
                log.exception("bridge tick failed")
            self._until_next_tick(seen)

    def _registrations(self) -> object:
        """Where the count of registrations and removals stands (None: Redis did not say)."""
        try:
            return self.redis.get(REGISTRATIONS_KEY)
        except Exception:  # the tick goes on at its interval
            return None

    def _until_next_tick(self, seen: object) -> None:
        """Wait ``remote_health_interval_s``, less once a registration or removal came since
        ``seen``: a new agent is checked, and routed when it answers, at once (its calls were
        503 for up to an interval after its registration)."""
        deadline = time.monotonic() + self.settings.remote_health_interval_s
        while (left := deadline - time.monotonic()) > 0:
            if self._stop.wait(min(NUDGE_POLL_S, left)):
                return
            now = self._registrations()
            if now is not None and now != seen:
                return

    def _rewrite_each(self) -> None:
        """Write the bridge's own lease again at once when it is gone from Redis (a FLUSHDB,
        a Redis back after longer than the TTL), not at the next tick only."""
        while not self._stop.wait(LEASE_CHECK_S):
            if not lease_missing(self.redis, self.own.instance):
                continue
            try:
                leases.renew(self.redis, replace(self.own, heartbeat_at=now_s()))
            except Exception:  # the next check, or the next tick, writes it
                log.exception("writing %s's lease again failed", self.own.instance)

    def tick(self) -> None:
        self.own = self._own_lease()
        try:
            self._hold_own_lease()
        finally:
            # Written while Redis does not answer too: the reaper takes the bridge's calls
            # for lost only once its lease is gone and this row is a TTL old.
            leases.record_instance(self.engine, self.own, READY)
        self._find_orphans()
        agents = {a.agent_id: a for a in load_all(self.engine) if a.protocol in (HTTP, A2A)}
        self.revoked = revocations.revoked_among(
            self.engine, [(a.agent_id, a.version) for a in agents.values()]
        )
        for agent_id in set(self.watched) - set(agents):
            self._drop(agent_id)
        for agent_id, agent in agents.items():
            watched = self.watched.get(agent_id)
            if watched is None or watched.agent != agent:
                self.registry.serve(agent)
                self.watched[agent_id] = (
                    Watched(agent) if watched is None else replace(watched, agent=agent)
                )
                log.info("serving remote agent %s %s at %s", agent_id, agent.version, agent.url)
        outcomes = self.checks.run(w.agent for w in self.watched.values())
        now = time.monotonic()
        for agent_id, passed in outcomes.items():
            watched = self.watched[agent_id]
            before = watched.health.state
            state = watched.health.observe(passed, now, self.policy)
            if state != before:
                log.info("remote agent %s: %s -> %s", agent_id, before, state)
        self._lapsed(time.monotonic())
        up = [
            w
            for w in self.watched.values()
            if w.health.routed and (w.agent.agent_id, w.agent.version) not in self.revoked
        ]
        # Before the leases change: once one agent of a capability is left in routing, its
        # tasks come on the capability's own queue, and must reach that agent.
        self.registry.route(w.agent.agent_id for w in up)
        for watched in self.watched.values():
            self._hold(watched)
        self._consume({q for w in up for q in _queues(w)})

    def _own_lease(self) -> Lease:
        """The bridge's own lease, with no card: it routes nothing, but tells the reaper that
        the tasks this process is running are held (without it, every call longer than a
        second was reaped as ``worker_lost``)."""
        return Lease(
            instance=self.consumer.hostname,
            state=READY,
            heartbeat_at=now_s(),
            started_at=self.started_at,
            lease_ttl_s=self._lease_ttl_s(),
            hostname=socket.gethostname(),
            pid=os.getpid(),
        )

    def _hold_own_lease(self) -> None:
        own = self.own
        alone = self._alone(own)
        if self.alone and not alone:
            log.warning(
                "another process renews %s's lease: start each bridge with a -n of its own;"
                " orphaned calls are not recovered meanwhile",
                own.instance,
            )
        self.alone = alone
        leases.renew(self.redis, own)

    def _alone(self, own: Lease) -> bool:
        """Whether this process alone is alive under its name: each process of a name
        stamps its own entry of the name's roll every tick and reads the others'; one
        stamped within the lease's TTL is alive (a process that stopped for good, or the
        one before a restart, stops counting after the TTL)."""
        key = f"{PROCESSES_PREFIX}{own.instance}"
        me = f"{own.hostname}:{own.pid}:{own.started_at}"
        with self.redis.pipeline(transaction=True) as pipe:
            pipe.hset(key, me, own.heartbeat_at)
            pipe.pexpire(key, int(2000 * own.lease_ttl_s))
            pipe.hgetall(key)
            roll = pipe.execute()[2]
        stale = [k for k, at in roll.items() if own.heartbeat_at - float(at) > own.lease_ttl_s]
        if stale:
            self.redis.hdel(key, *stale)
        return all(k.decode() == me for k in roll if k not in stale)

    def _leave_roll(self, own: Lease) -> bool:
        """Take this process off its name's roll; True if no other process of the name is
        alive (``_alone``)."""
        key = f"{PROCESSES_PREFIX}{own.instance}"
        with self.redis.pipeline(transaction=True) as pipe:
            pipe.hdel(key, f"{own.hostname}:{own.pid}:{own.started_at}")
            pipe.hgetall(key)
            roll = pipe.execute()[1]
        return not any(own.heartbeat_at - float(at) <= own.lease_ttl_s for at in roll.values())

    def _find_orphans(self) -> None:
        if self.on_orphans is None or not self.alone:
            return
        interval = self.settings.remote_health_interval_s
        found = orphans(
            self.engine,
            self.consumer,
            self.consumer.hostname,
            started_before_s=max(2.0, 2 * interval),
        )
        if found:
            self.on_orphans(found)

    def _lease_ttl_s(self) -> float:
        """A lease renewed once a health tick (its interval, then the checks) outlives three:
        the agents' leases were ``remote_lease_ttl_s`` alone, so with the interval raised
        toward it a healthy agent read as suspect (past half its TTL) before each tick, or
        expired between two."""
        return max(self.settings.remote_lease_ttl_s, 3 * self.settings.remote_health_interval_s)

    def _lease(self, watched: Watched) -> Lease:
        """The agent's lease: ``suspect`` while its checks say so (routed at a lower score),
        else ``ready``; it was ``ready`` either way, at the full score."""
        return Lease(
            instance=remote_instance(watched.agent.agent_id),
            state=SUSPECT if watched.health.state == SUSPECT else READY,
            heartbeat_at=now_s(),
            started_at=self.started_at,
            lease_ttl_s=self._lease_ttl_s(),
            hostname=socket.gethostname(),
            pid=os.getpid(),
            cards=tuple(
                card.ref()
                for card in watched.agent.cards
                if (card.agent_id, card.version) not in self.revoked
            ),
        )

    def _lapsed(self, now: float) -> None:
        """Take offline each agent whose lease ran out since this process last renewed it
        (the process stopped or stalled, or Redis did not answer, for longer than the TTL):
        routing has refused it since, and it comes back as after failed checks, dampened
        (``Health.expired``), not at the next pass."""
        ttl = self._lease_ttl_s()
        for agent_id, watched in self.watched.items():
            if watched.renewed_at is None or now - watched.renewed_at <= ttl:
                continue
            before = watched.health.state
            watched.health.expired(now)
            log.warning(
                "remote agent %s: %s -> %s (its lease ran out: last renewed %.1f s ago)",
                agent_id,
                before,
                watched.health.state,
                now - watched.renewed_at,
            )
            watched.renewed_at = None

    def _hold(self, watched: Watched) -> None:
        """Renew the agent's lease while it counts as up; give it up once it does not."""
        at = time.monotonic()  # no later than the lease's heartbeat: its lapse is not missed
        lease = self._lease(watched)
        state = watched.health.state if watched.health.routed else OFFLINE
        if watched.health.routed:
            leases.renew(self.redis, lease, removable=True)
            watched.renewed_at = at
        else:
            watched.renewed_at = None
            if watched.state != OFFLINE:
                leases.release(self.redis, lease)
        if state != watched.state or watched.health.routed:
            leases.record_instance(self.engine, lease, state)
            watched.state = state

    def _drop(self, agent_id: str) -> None:
        watched = self.watched.pop(agent_id)
        self.registry.forget(agent_id)
        lease = self._lease(watched)
        leases.release(self.redis, lease)
        leases.record_instance(self.engine, lease, OFFLINE)
        log.info("remote agent %s deregistered", agent_id)

    def _consume(self, wanted: set[str]) -> None:
        """Consume exactly the queues of the agents that count as up. The consumer's queues
        are not thread-safe: the changes run on its own loop."""
        for queue in wanted - self.consumed:
            self.consumer.call_soon(self.consumer.add_task_queue, queue)
        for queue in self.consumed - wanted:
            self.consumer.call_soon(self.consumer.cancel_task_queue, queue)
        self.consumed = set(wanted)


def _queues(watched: Watched) -> list[str]:
    """The capability's (for a card of every tenant's), the card's and the agent's own queue
    (a hint) of each card (``CardRef.queues``)."""
    instance = remote_instance(watched.agent.agent_id)
    return [q for card in watched.agent.cards for q in card.ref().queues(instance)]


def bridge_step(settings: Settings, registry: RemoteRegistry) -> type[bootsteps.StartStopStep]:
    """A consumer bootstep running the keeper for as long as the consumer runs."""

    class BridgeStep(bootsteps.StartStopStep):  # type: ignore[misc]
        requires = ("celery.worker.consumer.tasks:Tasks",)

        def __init__(self, consumer: Any, **kwargs: Any) -> None:
            super().__init__(consumer, **kwargs)
            self.keeper: RemoteKeeper | None = None

        def start(self, consumer: Any) -> None:
            if self.keeper is None:
                recover = getattr(consumer.app, "reach_recover_orphans", None)
                self.keeper = RemoteKeeper(consumer, settings, registry, recover)
                consumer.app.reach_bridge_keeper = self.keeper
                self.keeper.start()

        def shutdown(self, consumer: Any) -> None:
            if self.keeper is not None:
                self.keeper.stop()

    return BridgeStep
