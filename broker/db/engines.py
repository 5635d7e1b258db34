"""Engines. The API uses an async engine, the workers and CLI a sync one; both psycopg 3."""

from __future__ import annotations

import asyncio
import contextlib
import os
import select
import socket
import threading
import time
from typing import Any, cast

import psycopg
from psycopg.adapt import AdaptersMap
from psycopg.pq import ExecStatus
from psycopg.rows import DictRow, dict_row
from psycopg.types.json import Jsonb, set_json_dumps, set_json_loads
from sqlalchemy import URL, Engine, create_engine, event, exc, make_url
from sqlalchemy.dialects.postgresql import JSON, JSONB
from sqlalchemy.dialects.postgresql.psycopg import PGDialect_psycopg
from sqlalchemy.ext.asyncio import AsyncEngine, create_async_engine
from sqlalchemy.sql import ClauseElement
from sqlalchemy.sql.compiler import SQLCompiler

from broker import jsoncodec
from broker.settings import Settings

# A connection back in the pool for less than this is used again without a ping.
PING_IF_IDLE_S = 1.0

# How long a connection may take to open, and how long the kernel may go without a word from
# Postgres on an open one, unless the URL says otherwise (libpq's parameters, in its query).
# Without them a Postgres cut off by a partition (no reset, no answer) held every request and
# every worker's statement until the kernel gave up on the connection: many minutes, the
# API's waiting slots and pool held throughout. Keepalives end a quiet connection whose peer
# went (10 s idle, then 3 probes 5 s apart); ``tcp_user_timeout`` one whose sent bytes go
# unacknowledged for 15 s; ``connect_timeout`` a connection not made in 10 s.
LIBPQ_BOUNDS: dict[str, str] = {
    "connect_timeout": "10",
    "keepalives": "1",
    "keepalives_idle": "10",
    "keepalives_interval": "5",
    "keepalives_count": "3",
    "tcp_user_timeout": "15000",
}


def bounded(url: str | URL) -> URL:
    """``url`` with ``LIBPQ_BOUNDS`` added where its query does not name them."""
    url = make_url(url)
    missing = {name: value for name, value in LIBPQ_BOUNDS.items() if name not in url.query}
    return url.update_query_dict(missing)


# JSON binds and columns through orjson where it is exact: each engine's psycopg adapters,
# and through them the connections of our own (``_Statements``), not psycopg's globals.
JSON_CODEC: dict[str, Any] = {
    "json_serializer": jsoncodec.dumps_str,  # str: SQLAlchemy renders literals with it too
    "json_deserializer": jsoncodec.loads,
}


def sync_engine(settings: Settings, *, pool_size: int = 1, max_overflow: int = 2) -> Engine:
    # A prefork worker process runs one task at a time: one connection, and a little overflow
    # for the moments its lease thread or event hooks need another. A threads worker asks for
    # more, and no overflow: a connection opened and closed per statement cost more than
    # waiting for one of the pool's.
    # Last in, first out: the connection just returned goes out again, so a quiet worker keeps
    # using one and the rest sit. In turn (FIFO), each of a threads worker's ten sat past
    # PING_IF_IDLE_S between uses, and every claim and finish paid a ping first.
    engine = create_engine(
        bounded(settings.database_url),
        pool_size=pool_size,
        max_overflow=max_overflow,
        pool_use_lifo=True,
        **JSON_CODEC,
    )
    _ping_when_idle(engine)
    return engine


def _ping_when_idle(engine: Engine) -> None:
    """Pre-ping, but only connections that sat idle: a worker checks out twice per task, and a
    ping on every checkout was a tenth of its CPU. A connection that died in the last second
    (Postgres restarted mid-burst) fails one statement; the run task retries that message and
    the orphan check recovers a task it left running."""

    @event.listens_for(engine, "checkin")
    def stamp(dbapi_connection: Any, record: Any) -> None:
        record.info["checked_in_at"] = time.monotonic()

    @event.listens_for(engine, "checkout")
    def ping(dbapi_connection: Any, record: Any, proxy: Any) -> None:
        if _gone(dbapi_connection):
            raise exc.DisconnectionError()
        idle_since = record.info.get("checked_in_at")
        if idle_since is not None and time.monotonic() - idle_since < PING_IF_IDLE_S:
            return
        try:
            engine.dialect.do_ping(dbapi_connection)  # pool_pre_ping's: leaves no transaction
        except engine.dialect.loaded_dbapi.Error as error:
            # The pool drops this connection and checks out a fresh one.
            raise exc.DisconnectionError() from error


def async_engine(settings: Settings, *, pool_size: int = 20) -> AsyncEngine:
    # No pre-ping: it costs a round trip per request. A connection whose backend ended while
    # it sat in the pool (a Postgres restart) is seen at checkout without one (``_gone``) and
    # replaced; one lost without a word fails once (503), and SQLAlchemy then invalidates the
    # whole pool.
    # Under load many requests hold a connection across an await at once; a pool smaller
    # than that opens and closes an overflow connection per request (a fifth of the API's CPU
    # at 64 connections with 10).
    engine = create_async_engine(
        bounded(settings.database_url),
        pool_size=pool_size,
        max_overflow=10,
        pool_timeout=15,  # a request waits at most this for a connection, then 503
        pool_recycle=1800,
        pool_use_lifo=True,  # a quiet API keeps using its warmest connection
        **JSON_CODEC,
    )

    @event.listens_for(engine.sync_engine, "checkout")
    def replace_if_gone(dbapi_connection: Any, record: Any, proxy: Any) -> None:
        if _gone(dbapi_connection.driver_connection):
            raise exc.DisconnectionError()  # the pool drops it and checks out a fresh one

    return engine


def _json_adapters() -> AdaptersMap:
    """psycopg's adapters, with JSON written and read as ``JSON_CODEC`` says."""
    adapters = AdaptersMap(psycopg.adapters)
    set_json_dumps(JSON_CODEC["json_serializer"], adapters)
    set_json_loads(JSON_CODEC["json_deserializer"], adapters)
    return adapters


class _Statements:
    """SQLAlchemy Core statements compiled once for psycopg, and their parameters as psycopg
    takes them (JSON binds wrapped), for connections that skip SQLAlchemy's layers."""

    def __init__(self, url: str | URL) -> None:
        self._dialect = PGDialect_psycopg()  # type: ignore[no-untyped-call]
        args, kwargs = self._dialect.create_connect_args(bounded(url))  # type: ignore[no-untyped-call]
        self.connect_args: tuple[list[Any], dict[str, Any]] = (
            args,
            {**kwargs, "context": _json_adapters()},
        )
        self._compiled: dict[ClauseElement, tuple[str, SQLCompiler, tuple[str, ...]]] = {}

    def prepare(self, statement: ClauseElement, params: dict[str, Any]) -> tuple[str, Any]:
        known = self._compiled.get(statement)
        if known is None:
            compiled = cast(SQLCompiler, statement.compile(dialect=self._dialect))
            json_binds = tuple(
                name for name, bind in compiled.binds.items() if isinstance(bind.type, JSON | JSONB)
            )
            known = self._compiled[statement] = (str(compiled), compiled, json_binds)
        sql, compiled, json_binds = known
        values = dict(compiled.construct_params(params) or {})
        for name in json_binds:
            values[name] = Jsonb(values[name])
        return sql, values


def _gone(connection: psycopg.Connection[Any] | psycopg.AsyncConnection[Any] | None) -> bool:
    """Whether an idle connection cannot take a statement: none, closed or broken, or the
    server spoke while nothing was asked of it (Postgres restarted, or the backend was
    ended: its last word, an error, waits on the socket). That look costs no round trip,
    where SQLAlchemy's pre-ping costs one; a connection lost without a word (the network)
    still fails its next statement once."""
    if connection is None or connection.closed or connection.broken:
        return True
    # poll, not select: a process with many sockets open (the bridge, with a thousand calls
    # in flight) has descriptors past select's limit of 1,024.
    watch = select.poll()
    try:
        watch.register(connection.fileno(), select.POLLIN)
        return bool(watch.poll(0))  # readable, hung up or in error
    except (OSError, ValueError):
        return True


def _has_rows(cursor: psycopg.Cursor[Any] | psycopg.AsyncCursor[Any]) -> bool:
    """Whether the statement returned rows (a ``SELECT``, or ``RETURNING``). Read off the
    result's status: ``cursor.description`` would build a ``Column``, with a type look-up,
    for every column, on every statement."""
    result = cursor.pgresult
    return result is not None and result.status == ExecStatus.TUPLES_OK


class LoopConnection:
    """One psycopg connection of an event loop's own, for statements that go out one at a
    time (a ``Grouped``'s: a worker's claims, its finishes). The statements are SQLAlchemy
    Core's, compiled once for psycopg; they run without SQLAlchemy's pool, connection and
    result layers, which cost about as much as the round trip itself on a small statement
    (``docs/performance.md``). Rows come back as dicts, with psycopg's types, which are the
    ones SQLAlchemy hands on for these columns.

    Autocommit: each statement is atomic by itself. A connection found gone before a
    statement (``_gone``), or used from another event loop than the one it was opened on, is
    opened again first; one that breaks under a statement fails it
    (``INFRASTRUCTURE_ERRORS``) and is opened again for the next.

    A lock keeps it to one statement at a time, from its sending to its last row, whoever
    calls: two coroutines on one psycopg connection interleave their protocol, and ``_gone``
    reads the other's reply on the socket as the server's last word and closes the
    connection under it (a NULL connection pointer, a read that never returns, libpq
    crashing the process).

    A statement given ``timeout_s`` waits at most that for the lock and the connection, and
    is cancelled on the server at it (``_Deadline``): the lock is held at most
    ``CANCEL_WAIT_S`` past it, whatever Postgres does."""

    def __init__(self, url: str | URL) -> None:
        self._statements = _Statements(url)
        self._connection: psycopg.AsyncConnection[DictRow] | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._lock = asyncio.Lock()
        self._lock_loop: asyncio.AbstractEventLoop | None = None

    async def execute(
        self, statement: ClauseElement, params: dict[str, Any], *, timeout_s: float | None = None
    ) -> list[DictRow]:
        """The statement's rows; ``TimeoutError`` if ``timeout_s`` passes first (the statement
        cancelled, or its connection dropped)."""
        sql, values = self._statements.prepare(statement, params)
        if timeout_s is None:
            async with self._one_at_a_time():
                return await _run(await self._connect(), sql, values)
        deadline = asyncio.get_running_loop().time() + timeout_s
        lock = self._one_at_a_time()
        async with asyncio.timeout_at(deadline):
            await lock.acquire()
        try:
            async with asyncio.timeout_at(deadline):
                connection = await self._connect()
            with _Deadline(connection, deadline) as overdue:
                try:
                    rows = await _run(connection, sql, values)
                except psycopg.Error as exc:
                    if not overdue.passed:
                        raise
                    if not isinstance(exc, psycopg.errors.QueryCanceled):
                        await self._drop(connection)
                    raise TimeoutError(f"the statement passed its {timeout_s} s") from exc
                if overdue.passed:
                    await self._drop(connection)
                return rows
        finally:
            lock.release()

    async def _drop(self, connection: psycopg.AsyncConnection[DictRow]) -> None:
        """Close a connection a cancel request may still be on its way to: the statement it
        was sent for ended otherwise (it finished as its deadline passed, or failed another
        way), and the request, reaching Postgres late, would cancel whatever statement the
        connection ran next (one in a hundred statements that ended at their deadline
        cancelled the next one, answered as an outage). A statement the cancel did end
        (``QueryCanceled``) spent it, and keeps its connection."""
        if self._connection is connection:
            self._connection = None
        with contextlib.suppress(psycopg.Error, OSError):
            await connection.close()

    async def close(self) -> None:
        async with self._one_at_a_time():
            connection, self._connection = self._connection, None
            if connection is not None and self._loop is asyncio.get_running_loop():
                await connection.close()

    def _one_at_a_time(self) -> asyncio.Lock:
        """This loop's lock: an asyncio lock serves the loop it was first awaited on only."""
        loop = asyncio.get_running_loop()
        if self._lock_loop is not loop:
            self._lock, self._lock_loop = asyncio.Lock(), loop
        return self._lock

    async def _connect(self) -> psycopg.AsyncConnection[DictRow]:
        connection = self._connection
        loop = asyncio.get_running_loop()
        if self._loop is not loop or _gone(connection):
            if connection is not None and self._loop is loop:
                await connection.close()
            args, kwargs = self._statements.connect_args
            connection = self._connection = await psycopg.AsyncConnection.connect(
                *args, **kwargs, autocommit=True, row_factory=dict_row
            )
            self._loop = loop
        assert connection is not None
        return connection


async def _run(
    connection: psycopg.AsyncConnection[DictRow], sql: str, values: Any
) -> list[DictRow]:
    cursor = await connection.execute(sql, values)
    return await cursor.fetchall() if _has_rows(cursor) else []


# How long a statement past its deadline may take to end once Postgres is asked to cancel it.
# Postgres that answers ends it in milliseconds, and the connection is kept. One that says
# nothing (a partition) never does: the connection's socket is then shut and the statement
# fails at once, and the next opens a fresh connection. psycopg's own handling of a cancelled
# call waited 5 s for its cancel request to get through, then 5 s more for the statement,
# holding the connection, and every statement queued behind it, for 10 s past the deadline.
CANCEL_WAIT_S = 1.0


class _Deadline:
    """A statement's deadline on its connection: at it, a cancel request goes out beside the
    statement (which is not interrupted: psycopg's wait on it stays its own); ``CANCEL_WAIT_S``
    later, a statement still running has its socket shut (``_shut``)."""

    def __init__(self, connection: psycopg.AsyncConnection[Any], deadline: float) -> None:
        self.passed = False
        self._connection = connection
        self._loop = asyncio.get_running_loop()
        self._timer = self._loop.call_at(deadline, self._cancel)
        self._cancelling: asyncio.Task[None] | None = None

    def __enter__(self) -> _Deadline:
        return self

    def __exit__(self, *exc: object) -> None:
        self._timer.cancel()
        if self._cancelling is not None:
            self._cancelling.cancel()

    def _cancel(self) -> None:
        self.passed = True
        self._cancelling = self._loop.create_task(_request_cancel(self._connection))
        self._timer = self._loop.call_later(CANCEL_WAIT_S, _shut, self._connection)


async def _request_cancel(connection: psycopg.AsyncConnection[Any]) -> None:
    # A cancel request that fails or never gets through leaves the socket's shutting to end it.
    with contextlib.suppress(psycopg.Error):
        await connection.cancel_safe(timeout=CANCEL_WAIT_S)


def _shut(connection: psycopg.AsyncConnection[Any]) -> None:
    """End the connection under the statement waiting on it: its socket reads as closed, the
    statement fails (``OperationalError``), the connection is broken and the next statement
    opens another (``_gone``). Shut, not closed: the descriptor stays psycopg's (its wait
    watches it) until the connection is closed, so no new socket can take its number."""
    try:
        with socket.socket(fileno=os.dup(connection.fileno())) as sock:
            sock.shutdown(socket.SHUT_RDWR)
    except (OSError, psycopg.Error):
        pass  # closed already


class ThreadConnection:
    """``LoopConnection`` for threads: one psycopg connection for statements that go out one
    at a time (a ``ThreadGrouped``'s: a threads or prefork worker's claims, its finishes).
    A lock keeps it to one statement at a time; a process that forked opens its own."""

    def __init__(self, url: str | URL) -> None:
        self._statements = _Statements(url)
        self._connection: psycopg.Connection[DictRow] | None = None
        self._pid = 0
        self._lock = threading.Lock()

    def execute(self, statement: ClauseElement, params: dict[str, Any]) -> list[DictRow]:
        sql, values = self._statements.prepare(statement, params)
        with self._lock:
            cursor = self._connect().execute(sql, values)
            return cursor.fetchall() if _has_rows(cursor) else []

    def close(self) -> None:
        with self._lock:
            connection, self._connection = self._connection, None
            if connection is not None and self._pid == os.getpid():
                connection.close()

    def _connect(self) -> psycopg.Connection[DictRow]:
        connection = self._connection
        if self._pid != os.getpid() or _gone(connection):
            if connection is not None and self._pid == os.getpid():
                connection.close()
            args, kwargs = self._statements.connect_args
            connection = self._connection = psycopg.Connection.connect(
                *args, **kwargs, autocommit=True, row_factory=dict_row
            )
            self._pid = os.getpid()
        assert connection is not None
        return connection
