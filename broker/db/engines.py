"""Engines. The API uses an async engine, the workers and CLI a sync one; both psycopg 3."""

from __future__ import annotations

from sqlalchemy import Engine, create_engine
from sqlalchemy.ext.asyncio import AsyncEngine, create_async_engine

from broker.settings import Settings


def sync_engine(settings: Settings, *, pool_size: int = 2) -> Engine:
    return create_engine(
        settings.database_url, pool_size=pool_size, max_overflow=2, pool_pre_ping=True
    )


def async_engine(settings: Settings, *, pool_size: int = 10) -> AsyncEngine:
    return create_async_engine(
        settings.database_url,
        pool_size=pool_size,
        max_overflow=10,
        pool_pre_ping=True,
        pool_timeout=5,  # a request waits at most this for a connection, then 503
    )
