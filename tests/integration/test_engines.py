"""The workers' engine pings a pooled connection only when it sat idle, and a connection whose
server process died while idle is replaced, not handed out."""

from __future__ import annotations

import time

from sqlalchemy import Engine, text

from broker.db.engines import PING_IF_IDLE_S, sync_engine
from broker.settings import Settings
from tests.eventually import eventually


def _backend_pid(engine: Engine) -> int:
    with engine.connect() as conn:
        return int(conn.execute(text("SELECT pg_backend_pid()")).scalar_one())


def _running(engine: Engine, pid: int) -> bool:
    query = text("SELECT count(*) FROM pg_stat_activity WHERE pid = :pid")
    with engine.connect() as conn:
        return bool(conn.execute(query, {"pid": pid}).scalar_one())


def test_a_connection_killed_while_idle_is_replaced_at_checkout(settings: Settings) -> None:
    engine, killer = sync_engine(settings), sync_engine(settings)
    try:
        first = _backend_pid(engine)
        with killer.begin() as conn:
            conn.execute(text("SELECT pg_terminate_backend(:pid)"), {"pid": first})
        eventually(lambda: not _running(killer, first), "the backend terminated")
        time.sleep(PING_IF_IDLE_S + 0.2)  # idle past the threshold: this checkout pings
        assert _backend_pid(engine) != first
    finally:
        engine.dispose()
        killer.dispose()


def test_a_connection_back_in_the_pool_is_reused_without_reconnecting(settings: Settings) -> None:
    engine = sync_engine(settings)
    try:
        first = _backend_pid(engine)
        assert {_backend_pid(engine) for _ in range(20)} == {first}
        time.sleep(PING_IF_IDLE_S + 0.2)  # pinged this time, and alive: still the same one
        assert _backend_pid(engine) == first
    finally:
        engine.dispose()
