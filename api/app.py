"""The FastAPI app: the composition root on the API side."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import redis.asyncio as aioredis
from fastapi import FastAPI

from api import errors
from api.deps import KeyCache, TraceMiddleware
from api.routes import agents, health, tasks
from broker.catalog import TimedCache
from broker.db.engines import async_engine
from broker.dispatch import Dispatcher
from broker.settings import Settings


def create_app(settings: Settings) -> FastAPI:
    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        yield
        await app.state.engine.dispose()
        await app.state.redis.aclose()
        app.state.dispatcher.close()

    app = FastAPI(
        title="Agent-Reach",
        version="0.1.0",
        summary="Send an envelope to a capability; poll, wait, stream or be called back.",
        lifespan=lifespan,
    )
    app.state.settings = settings
    app.state.engine = async_engine(settings)
    app.state.redis = aioredis.from_url(settings.redis_url, socket_timeout=2)
    app.state.dispatcher = Dispatcher(settings)
    app.state.key_cache = KeyCache(ttl_s=settings.key_cache_s)
    app.state.catalog_cache = TimedCache(ttl_s=settings.card_cache_s)
    errors.install(app)
    app.add_middleware(TraceMiddleware)
    app.include_router(health.router)
    app.include_router(tasks.router)
    app.include_router(agents.router)
    return app


def create_app_from_env() -> FastAPI:
    """For ``uvicorn api.app:create_app_from_env --factory``: settings from the environment."""
    return create_app(Settings())
