"""Every connection to Postgres is bounded: one that is not made in ``connect_timeout`` fails
as an outage (the API answers 503), and an open one the kernel hears nothing from is ended by
keepalives and ``tcp_user_timeout`` (``broker.db.engines.LIBPQ_BOUNDS``). Before, a Postgres
behind a partition held every request that needed it for as long as it lasted."""

from __future__ import annotations

import asyncio
import contextlib
import socket
import threading
from collections.abc import Iterator
from typing import Any

import httpx
import psycopg
import pytest
import sqlalchemy.exc
from sqlalchemy import select, text

from api.app import create_app
from broker.db.engines import (
    LIBPQ_BOUNDS,
    LoopConnection,
    ThreadConnection,
    async_engine,
    bounded,
    sync_engine,
)
from broker.settings import Settings
from tests.integration.conftest import KeyMaker
from tests.integration.stack import ServedApp

# Only a bound on a hang: a call still waiting then has failed the test.
HANG_BOUND_S = 90
PROBE = "SELECT 1"


def libpq_options(raw: Any) -> dict[str, str]:
    """The options a psycopg connection was made with, as libpq has them."""
    return {o.keyword.decode(): (o.val or b"").decode() for o in raw.pgconn.info}


def bounds_of(raw: Any) -> dict[str, str]:
    options = libpq_options(raw)
    return {name: options.get(name, "") for name in LIBPQ_BOUNDS}


def test_every_kind_of_connection_carries_the_bounds(settings: Settings) -> None:
    engine = sync_engine(settings)
    try:
        with engine.connect() as conn:
            assert bounds_of(conn.connection.driver_connection) == LIBPQ_BOUNDS
    finally:
        engine.dispose()

    threaded = ThreadConnection(settings.database_url)
    try:
        threaded.execute(select(1), {})
        assert bounds_of(threaded._connection) == LIBPQ_BOUNDS
    finally:
        threaded.close()

    async def on_the_loop() -> tuple[dict[str, str], dict[str, str]]:
        api_engine = async_engine(settings, pool_size=1)
        own = LoopConnection(settings.database_url)
        try:
            async with api_engine.connect() as conn:
                raw = await conn.get_raw_connection()
                api_bounds = bounds_of(raw.driver_connection)
            await own.execute(select(1), {})
            return api_bounds, bounds_of(own._connection)
        finally:
            await own.close()
            await api_engine.dispose()

    assert asyncio.run(on_the_loop()) == (LIBPQ_BOUNDS, LIBPQ_BOUNDS)


def test_a_bound_the_url_names_is_kept() -> None:
    url = bounded("postgresql+psycopg://postgres@127.0.0.1/reach?connect_timeout=3")
    assert url.query["connect_timeout"] == "3"
    assert url.query["tcp_user_timeout"] == LIBPQ_BOUNDS["tcp_user_timeout"]


@pytest.fixture
def silent_postgres() -> Iterator[str]:
    """A database URL whose server takes connections and never says a word (a Postgres
    behind a partition, or hung): what it is sent is read and dropped."""
    listener = socket.create_server(("127.0.0.1", 0))
    held: list[socket.socket] = []
    stop = threading.Event()

    def take() -> None:
        listener.settimeout(0.2)
        while not stop.is_set():
            with contextlib.suppress(TimeoutError):
                held.append(listener.accept()[0])

    taker = threading.Thread(target=take, daemon=True)
    taker.start()
    port = listener.getsockname()[1]
    try:
        yield f"postgresql+psycopg://postgres@127.0.0.1:{port}/reach"
    finally:
        stop.set()
        taker.join()
        for conn in held:
            conn.close()
        listener.close()


def test_a_postgres_that_never_answers_fails_each_kind_of_connect_as_an_outage(
    settings: Settings, silent_postgres: str
) -> None:
    silent = settings.model_copy(update={"database_url": silent_postgres})
    outcomes: dict[str, BaseException | None] = {}

    def sync_connect() -> None:
        engine = sync_engine(silent)
        try:
            with engine.connect() as conn:
                conn.execute(text(PROBE))
        finally:
            engine.dispose()

    def thread_connect() -> None:
        ThreadConnection(silent_postgres).execute(select(1), {})

    for name, call in {"sync engine": sync_connect, "thread connection": thread_connect}.items():

        def run(name: str = name, call: Any = call) -> None:
            try:
                call()
                outcomes[name] = None
            except BaseException as exc:  # what it raised is the finding
                outcomes[name] = exc

        runner = threading.Thread(target=run, daemon=True)
        runner.start()
        runner.join(HANG_BOUND_S)
        assert name in outcomes, f"the {name} still waited for Postgres after {HANG_BOUND_S} s"

    async def async_connects() -> None:
        engine = async_engine(silent, pool_size=1)
        own = LoopConnection(silent_postgres)
        for name, attempt in (
            ("async engine", engine.connect().__aenter__()),
            ("loop connection", own.execute(select(1), {})),
        ):
            try:
                await asyncio.wait_for(attempt, HANG_BOUND_S)
                outcomes[name] = None
            except TimeoutError:
                raise AssertionError(
                    f"the {name} still waited for Postgres after {HANG_BOUND_S} s"
                ) from None
            except Exception as exc:  # what it raised is the finding
                outcomes[name] = exc
        await engine.dispose()

    asyncio.run(async_connects())

    assert set(outcomes) == {"sync engine", "thread connection", "async engine", "loop connection"}
    outages = (sqlalchemy.exc.OperationalError, psycopg.OperationalError)
    for name, exc in outcomes.items():
        assert isinstance(exc, outages), f"the {name}: {exc!r}"


def test_an_api_whose_postgres_never_answers_answers_503_service_unavailable(
    settings: Settings, silent_postgres: str, make_key: KeyMaker
) -> None:
    # Given an API whose Postgres takes connections and never answers
    _, token = make_key()
    silent = settings.model_copy(update={"database_url": silent_postgres})
    with ServedApp(create_app(silent)) as served:
        # When a request needs Postgres (the key is looked up there)
        answer = httpx.get(
            f"{served.url}/tasks",
            headers={"Authorization": f"Bearer {token}"},
            timeout=HANG_BOUND_S,
        )
    # Then it is answered as an outage, not held for as long as Postgres stays silent
    assert answer.status_code == 503, answer.text
    assert answer.json()["code"] == "service_unavailable"
