"""What a request handler may use, built once per app and closed with it.

``create_app`` builds one ``Services`` (the composition root); handlers reach it through the
``services`` dependency, typed, instead of attributes on ``app.state``.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import anyio
import redis.asyncio as aioredis
from fastapi import Request
from sqlalchemy.ext.asyncio import AsyncEngine

from api.callers import Budget, KeyCache, TenantOfKey
from api.sse import StreamSlots
from api.stopping import Stopping
from broker import redisclients
from broker.cache import TimedCache
from broker.db.engines import async_engine
from broker.registry.figures import Aggregates
from broker.settings import Settings
from broker.tasks.admission import Door
from broker.tasks.backpressure import (
    Depths,
    QueueBound,
    TokenBucket,
    postgres_queued,
    redis_depths,
)
from broker.tasks.cancellation import Canceller
from broker.tasks.dispatch import Dispatcher
from broker.tasks.eventhub import EventHub
from broker.tasks.events import EventLog
from broker.tasks.intake import Intake
from broker.tasks.submission import GroupInsert
from broker.tenancy.heavy import OneAtATime
from broker.tenancy.usage import PostgresHeld, Quota, Quotas, RedisHeld
from broker.webhooks.ssrf import HostLookups

READINESS_S = 1.0


@dataclass
class Services:
    settings: Settings
    engine: AsyncEngine
    redis: aioredis.Redis
    # The Celery broker's Redis when it is not ``redis`` (its queue depths are read there).
    broker_redis: aioredis.Redis | None
    dispatcher: Dispatcher
    inserter: GroupInsert
    key_cache: KeyCache
    # Every authenticated request of a tenant takes one of its tokens here (in this process).
    requests: Budget
    tenant_of_key: TenantOfKey
    lookups: HostLookups
    card_cache: TimedCache
    hub: EventHub
    door: Door
    queue_bound: QueueBound
    event_log: EventLog
    intake: Intake
    canceller: Canceller
    streams: StreamSlots
    # The tenants' figures and series: one at a time per tenant, each kept a few seconds.
    aggregates: Aggregates
    # A tenant's reads whose cost grows with its history (lists): one at a time per kind.
    heavy_reads: OneAtATime
    # When the system gauges were last computed (``system_gauges``); None before the first.
    gauges_refreshed_at: float | None = None
    # ``/readyz``'s answer, for a second: it needs no key (see ``api.routes.health``).
    readiness: TimedCache = field(default_factory=lambda: TimedCache(ttl_s=READINESS_S))
    # Set once the server is told to stop: streams end, waits answer (``api.stopping``).
    stopping: Stopping = field(default_factory=Stopping)

    @classmethod
    def build(cls, settings: Settings) -> Services:
        engine = async_engine(settings)
        # Bounded and blocking: under a burst, requests wait their turn for a connection (up
        # to 10 s) instead of failing once a fixed number are open.
        pool = redisclients.async_blocking_pool(
            settings.redis_url, max_connections=64, timeout=10, socket_timeout=5
        )
        redis = aioredis.Redis(connection_pool=pool)
        broker = settings.celery_broker_url
        broker_redis = None
        if broker != settings.redis_url and broker.startswith(("redis://", "rediss://")):
            broker_redis = redisclients.async_client(broker, socket_timeout=5)
        dispatcher = Dispatcher(settings)
        bucket = TokenBucket(settings.rate_limit_per_s, settings.rate_limit_burst)
        heavy_reads = OneAtATime()
        intake = Intake(
            settings=settings,
            engine=engine,
            door=Door(redis, bucket),
            cards=TimedCache(ttl_s=settings.card_cache_s),
            queue_bound=QueueBound(
                _queue_depths(settings, redis, broker_redis, dispatcher),
                settings.max_queue_depth,
                queued=postgres_queued(engine),
                max_share=settings.max_queue_share,
                fair_slice=settings.queue_fair_slice,
            ),
            lookups=HostLookups(
                threads=settings.dns_threads,
                timeout_s=settings.dns_timeout_s,
                per_tenant=settings.dns_lookups_per_tenant,
            ),
            inserter=GroupInsert(engine),
            dispatcher=dispatcher,
            event_log=EventLog(redis, settings.result_ttl_s, settings.event_log_max_bytes),
            quota=Quotas(
                rows=Quota(
                    PostgresHeld(engine.url),
                    settings.tenant_max_held_bytes,
                    what="tasks, webhook deliveries and sessions hold",
                ),
                events=Quota(
                    RedisHeld(redis),
                    settings.tenant_max_event_bytes,
                    setting="REACH_TENANT_MAX_EVENT_BYTES",
                    what="event logs hold",
                ),
            ),
        )
        return cls(
            settings=settings,
            engine=engine,
            redis=redis,
            broker_redis=broker_redis,
            dispatcher=dispatcher,
            inserter=intake.inserter,
            key_cache=KeyCache(
                ttl_s=settings.key_cache_s,
                lookups=Budget(
                    settings.auth_lookups_per_s,
                    reason="auth_lookups",
                    refusal="too many unknown API keys from this address",
                ),
            ),
            requests=Budget(
                settings.request_rate_per_s,
                reason="request_rate",
                refusal=f"more than {settings.request_rate_per_s:g} requests/s for this tenant",
            ),
            tenant_of_key=TenantOfKey(),
            lookups=intake.lookups,
            card_cache=intake.cards,
            hub=EventHub(redis),
            door=intake.door,
            queue_bound=intake.queue_bound,
            event_log=intake.event_log,
            intake=intake,
            canceller=Canceller(
                engine, redis, intake.cards, dispatcher, intake.event_log, intake.queue_bound
            ),
            streams=StreamSlots(settings.max_streams_per_tenant),
            aggregates=Aggregates(ttl_s=settings.figures_cache_s, reads=heavy_reads),
            heavy_reads=heavy_reads,
        )

    async def close(self) -> None:
        await self.hub.close()
        await self.queue_bound.close()
        await self.intake.quota.close()
        await self.inserter.close()
        await self.engine.dispose()
        for client in (self.redis, self.broker_redis):
            if client is not None:
                await client.aclose()
                await client.connection_pool.disconnect()
        self.dispatcher.close()
        self.lookups.close()


def _queue_depths(
    settings: Settings,
    redis: aioredis.Redis,
    broker_redis: aioredis.Redis | None,
    dispatcher: Dispatcher,
) -> Depths:
    if settings.celery_broker_url == settings.redis_url:
        return redis_depths(redis)
    if broker_redis is not None:
        return redis_depths(broker_redis)
    return lambda queues: anyio.to_thread.run_sync(dispatcher.queue_depths, queues)


def services(request: Request) -> Services:
    """The app's services (a dependency, and a plain call where a request is at hand)."""
    found: Services = request.app.state.services
    return found
