"""The FastAPI app: the composition root on the API side."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import anyio
import redis.asyncio as aioredis
from fastapi import FastAPI

from api import errors, system_gauges
from api.deps import (
    KeyCache,
    PerClientBudget,
    TenantOfKey,
    TraceMiddleware,
    TraceparentFromTraceId,
    WaitingLimit,
)
from api.routes import agents, callbacks, health, metrics, tasks, webhooks
from broker import logs, otel
from broker.admission import Door
from broker.backpressure import Depths, QueueBound, TokenBucket, redis_depths
from broker.catalog import TimedCache
from broker.db.engines import async_engine
from broker.dispatch import Dispatcher
from broker.eventhub import EventHub
from broker.events import EventLog
from broker.settings import Settings
from broker.submission import GroupInsert
from broker.webhooks.ssrf import HostLookups


def create_app(settings: Settings) -> FastAPI:
    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        gauges = asyncio.create_task(
            system_gauges.keep_fresh(app.state, settings.metrics_refresh_s),
            name="reach-system-gauges",
        )
        yield
        gauges.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await gauges
        await app.state.hub.close()
        await app.state.engine.dispose()
        await app.state.redis.aclose()
        await app.state.redis.connection_pool.disconnect()
        app.state.dispatcher.close()
        app.state.lookups.close()

    logs.capture_context()
    app = FastAPI(
        title="Agent-Reach",
        version="0.1.0",
        summary="Send an envelope to a capability; poll, wait, stream or be called back.",
        lifespan=lifespan,
    )
    app.state.settings = settings
    app.state.engine = async_engine(settings)
    app.state.inserter = GroupInsert(app.state.engine)
    # Bounded and blocking: under a burst, requests wait their turn for a connection (up to
    # 10 s) instead of failing once a fixed number are open.
    pool = aioredis.BlockingConnectionPool.from_url(
        settings.redis_url, max_connections=64, timeout=10, socket_timeout=5
    )
    app.state.redis = aioredis.Redis(connection_pool=pool)
    app.state.dispatcher = Dispatcher(settings)
    app.state.key_cache = KeyCache(
        ttl_s=settings.key_cache_s, lookups=PerClientBudget(settings.auth_lookups_per_s)
    )
    app.state.tenant_of_key = TenantOfKey()
    app.state.lookups = HostLookups(
        threads=settings.dns_threads,
        timeout_s=settings.dns_timeout_s,
        per_tenant=settings.dns_lookups_per_tenant,
    )
    app.state.catalog_cache = TimedCache(ttl_s=settings.card_cache_s)
    app.state.hub = EventHub(app.state.redis)
    bucket = TokenBucket(settings.rate_limit_per_s, settings.rate_limit_burst)
    app.state.door = Door(app.state.redis, bucket)
    app.state.queue_bound = QueueBound(_queue_depths(app, settings), settings.max_queue_depth)
    app.state.event_log = EventLog(app.state.redis, settings.result_ttl_s)
    errors.install(app)
    app.add_middleware(
        WaitingLimit,
        limit=settings.max_requests_waiting,
        per_tenant=settings.max_requests_waiting_per_tenant,
        tenants=app.state.tenant_of_key,
    )
    app.add_middleware(TraceMiddleware, otel=settings.otel)
    if settings.otel:
        otel.instrument_api(app)
        # The instrumentation wraps the whole middleware stack; the X-Trace-Id shim must wrap
        # it in turn, so the span it starts continues our trace.
        build_stack = app.build_middleware_stack
        app.build_middleware_stack = lambda: TraceparentFromTraceId(build_stack())  # type: ignore[method-assign]
    app.include_router(health.router)
    app.include_router(tasks.router)
    app.include_router(agents.router)
    app.include_router(metrics.router)
    app.include_router(webhooks.router)
    app.include_router(callbacks.router)
    return app


def _queue_depths(app: FastAPI, settings: Settings) -> Depths:
    broker = settings.celery_broker_url
    if broker == settings.redis_url:
        return redis_depths(app.state.redis)
    if broker.startswith(("redis://", "rediss://")):
        return redis_depths(aioredis.from_url(broker, socket_timeout=5))
    return lambda queues: anyio.to_thread.run_sync(app.state.dispatcher.queue_depths, queues)


def create_app_from_env() -> FastAPI:
    """For ``uvicorn api.app:create_app_from_env --factory``: settings from the environment,
    and structured logs (JSON unless in a terminal)."""
    logs.configure()
    settings = Settings()
    if settings.otel:
        otel.setup_tracing("agent-reach-api")
    return create_app(settings)
