"""Engines. The API uses an async engine, the workers and CLI a sync one; both psycopg 3."""

from __future__ import annotations

from sqlalchemy import Engine, create_engine
from sqlalchemy.ext.asyncio import AsyncEngine, create_async_engine

from broker.settings import Settings


def sync_engine(settings: Settings, *, pool_size: int = 1) -> Engine:
    # A worker process runs one task at a time: one connection, and a little overflow for the
    # moments its lease thread or event hooks need another.
    return create_engine(
        settings.database_url, pool_size=pool_size, max_overflow=2, pool_pre_ping=True
    )


def async_engine(settings: Settings, *, pool_size: int = 20) -> AsyncEngine:
    # No pre-ping: it costs a round trip per request. A connection lost with a Postgres
    # restart fails once (503), and SQLAlchemy then invalidates the whole pool.
    # Under load many requests hold a connection across an await at once; a pool smaller
    # than that opens and closes an overflow connection per request (a fifth of the API's CPU
    # at 64 connections with 10).
    return create_async_engine(
        settings.database_url,
        pool_size=pool_size,
        max_overflow=10,
        pool_timeout=15,  # a request waits at most this for a connection, then 503
        pool_recycle=1800,
    )
