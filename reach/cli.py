"""``reach``: the operator's commands, added to the ``reach`` command of the client
distribution (``reach_client.cli``) through the ``reach.commands`` entry point.

reach migrate                          apply the schema migrations
reach keys create --tenant T --capabilities 'invoice.*,echo' [--tenant-admin] [--admin]
                 [--name N]
reach keys revoke KEY_ID
reach keys list [--tenant T]
reach api [--host H] [--port 8000] [--workers N]
                                       serve the API (N processes behind one port)
reach dev [--port 8000]                run the whole stack on this machine
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable
from typing import TYPE_CHECKING, Any
from urllib.parse import urlsplit

if TYPE_CHECKING:
    from pydantic import ValidationError

    from broker.settings import Settings

# The server's modules are imported when an operator command runs, not when `reach submit`
# builds its parser: a user's command should not pay for SQLAlchemy and Celery.
Command = Callable[[argparse.Namespace, "Settings"], int]


def _keys_create(args: argparse.Namespace, settings: Settings) -> int:
    from broker.db.engines import sync_engine
    from broker.tenancy import key_store

    patterns = [p.strip() for p in args.capabilities.split(",") if p.strip()]
    key_id, token = key_store.create_key(
        sync_engine(settings),
        args.tenant,
        patterns,
        is_admin=args.admin,
        tenant_admin=args.tenant_admin,
        name=args.name,
    )
    if _as_json(args):
        kind = "admin" if args.admin else "tenant_admin" if args.tenant_admin else "tenant"
        made = {"key_id": key_id, "tenant": args.tenant, "capabilities": patterns}
        print(json.dumps({**made, "kind": kind, "api_key": token}))
        return 0
    print(f"key_id:  {key_id}\ntenant:  {args.tenant}\nallows:  {', '.join(patterns)}")
    if args.admin or args.tenant_admin:
        print("manages: the whole tenant" + (" (and operator actions)" if args.admin else ""))
    print(f"api key: {token}\n(shown once: it is stored only as a hash)")
    return 0


def _keys_revoke(args: argparse.Namespace, settings: Settings) -> int:
    from reach_client.cli import exits

    from broker.db.engines import sync_engine
    from broker.tenancy import key_store

    if key_store.revoke_key(sync_engine(settings), args.key_id):
        print(json.dumps({"revoked": args.key_id}) if _as_json(args) else f"revoked {args.key_id}")
        return 0
    print(f"reach: no active key {args.key_id}", file=sys.stderr)
    return exits.USAGE


def _keys_list(args: argparse.Namespace, settings: Settings) -> int:
    from broker.db.engines import sync_engine
    from broker.tenancy import key_store

    rows = key_store.list_keys(sync_engine(settings), args.tenant)
    if _as_json(args):  # one document, as the user commands' --json prints
        print(json.dumps(rows, default=_iso))
        return 0
    for row in rows:
        print(json.dumps(row, default=_iso))
    return 0


def _as_json(args: argparse.Namespace) -> bool:
    """``reach --json <operator command>``: its answer as JSON only on stdout."""
    return bool(getattr(args, "json", False))


def _iso(value: Any) -> str:
    """A row's timestamp as the API writes one (ISO 8601, ``T`` between date and time)."""
    return value.isoformat() if hasattr(value, "isoformat") else str(value)


def _migrate(args: argparse.Namespace, settings: Settings) -> int:
    from reach_client.cli import exits

    from reach import migrate

    try:
        migrate.upgrade(settings.database_url)
    except migrate.MigrationBlocked as exc:
        print(f"error: {exc}", file=sys.stderr)
        return exits.USAGE
    print(json.dumps({"migrated": "head"}) if _as_json(args) else "migrated to head")
    return 0


# What `reach api` serves: the app factory, and the protocol that bounds each connection's
# kernel send buffer (docs/security.md). Running uvicorn by hand takes the same two.
API_APP = "api.app:create_app_from_env"
API_PROTOCOL = "api.connections:Protocol"
# How long a stopping API waits for its connections, then closes them (uvicorn waited without
# end). Its streams and waits end within seconds of the signal (``api.stopping``); what is
# left is a client too slow to take its answer. Compose's grace period for it is longer.
API_STOP_TIMEOUT_S = 15


def _api(args: argparse.Namespace, settings: Settings) -> int:
    import uvicorn

    from broker.observability import logs

    if args.workers > 1:
        # Each process counts its own requests. Named in the environment before uvicorn
        # spawns them, one folder holds every process's figures and each /metrics answers
        # for them all; this process holds the folder's lock and removes it when it exits.
        from broker.observability import metrics_dirs

        metrics_dirs.choose()
    # uvicorn's own lines (its start, its errors, each request's access line) go through the
    # broker's log format, as every other line does: with its own configuration they were
    # plain text beside JSON, and their text unescaped. Each process's app sets the format
    # up again (``api.app``); this process's is the supervisor's.
    logs.configure()
    uvicorn.run(
        API_APP,
        factory=True,
        http=API_PROTOCOL,
        host=args.host,
        port=args.port,
        workers=args.workers,
        timeout_graceful_shutdown=API_STOP_TIMEOUT_S,
        log_config=None,
    )
    return 0


def _dev(args: argparse.Namespace, settings: Settings) -> int:
    from reach.devstack import run_dev_stack

    return run_dev_stack(port=args.port, flower_port=args.flower_port)


def _operator(command: Command) -> Callable[[argparse.Namespace], int]:
    """The handler: the server's settings from the environment (a line for each one refused,
    exit status 2), a refusal printed with its code (exit status 2), and Postgres or Redis
    out of reach in one line (exit status 7, as the user's commands say of the API)."""

    def handle(args: argparse.Namespace) -> int:
        from pydantic import ValidationError
        from reach_client.cli import exits

        from broker.errors import ReachError
        from broker.settings import Settings

        try:
            settings = Settings()
        except ValidationError as exc:
            for line in settings_refused(exc):
                print(f"error: {line}", file=sys.stderr)
            return exits.USAGE
        try:
            return command(args, settings)
        except ReachError as exc:
            print(f"error ({exc.code}): {exc.message}", file=sys.stderr)
            return exits.USAGE
        except Exception as exc:
            refused = _url_refused(exc)
            if refused is not None:  # an option of the URL libpq cannot take
                print(f"reach: REACH_DATABASE_URL: {refused}", file=sys.stderr)
                return exits.USAGE
            where = _unreachable(exc, settings)
            if where is None:
                raise
            reason = " ".join(str(getattr(exc, "orig", None) or exc).split())
            print(f"reach: cannot connect to {where}: {reason}", file=sys.stderr)
            return exits.UNREACHABLE

    return handle


def settings_refused(exc: ValidationError) -> list[str]:
    """What is wrong with each setting ``exc`` refused, named as the environment names it."""
    from pydantic import AliasChoices

    from broker.settings import Settings

    # A setting read from several variables is named by its first (REACH_DATABASE_URL).
    aliases = {
        str(alias.choices[0]): " or ".join(map(str, alias.choices))
        for alias in (field.validation_alias for field in Settings.model_fields.values())
        if isinstance(alias, AliasChoices)
    }
    lines = []
    for error in exc.errors():
        name, *item = error["loc"]
        variable = aliases.get(str(name)) or f"REACH_{str(name).upper()}"
        if item and isinstance(item[0], int):  # a comma list's entry
            variable += f" (entry {item[0] + 1})"
        lines.append(f"{variable}: {error['msg'].removeprefix('Value error, ')}")
    return lines


def _unreachable(exc: Exception, settings: Settings) -> str | None:
    """The service ``exc`` says cannot be reached (its URL without the password), or None."""
    import psycopg
    import redis
    import sqlalchemy.exc

    cause = exc.orig if isinstance(exc, sqlalchemy.exc.OperationalError) else exc
    # Exactly OperationalError: its subclasses (a cancelled query, a lock) are not connections.
    if type(cause) is psycopg.OperationalError:
        return without_password(settings.database_url)
    if isinstance(exc, redis.ConnectionError):
        return without_password(settings.redis_url)
    return None


def _url_refused(exc: Exception) -> str | None:
    """What libpq refused of the database URL's options (``?connect_timeout=abc``, an option
    it does not know), or None: psycopg's plain ``ProgrammingError``, raised before any
    statement (a statement's errors are its subclasses, with a SQLSTATE)."""
    import traceback

    import psycopg

    cause = getattr(exc, "orig", None) or exc
    if type(cause) is not psycopg.ProgrammingError or cause.sqlstate is not None:
        return None
    # raised as a connection was made, not by a statement's misuse (a closed cursor, a
    # parameter count): those are bugs, with their traceback
    frames = traceback.extract_tb(cause.__traceback__)
    connecting = any(
        frame.name == "connect" and "psycopg" in frame.filename.replace("\\", "/")
        for frame in frames
    )
    return str(cause) if connecting else None


def without_password(url: str) -> str:
    """``url`` for a message: its password, if any, replaced by ``***``, whether in its
    userinfo or in its query (libpq's ``?password=``)."""
    from reach.localservices import unsplit

    parts = urlsplit(url)
    pairs = [pair.partition("=") for pair in parts.query.split("&")] if parts.query else []
    in_query = any(name.lower() == "password" and eq for name, eq, _ in pairs)
    if parts.password is None and not in_query:
        return url  # as given: urlunsplit drops the "//" of postgresql:///db?host=/sock
    if parts.password is not None:
        user, _, host = parts.netloc.rpartition("@")
        parts = parts._replace(netloc=f"{user.split(':', 1)[0]}:***@{host}")
    if in_query:
        hidden = [
            f"{name}={'***' if name.lower() == 'password' else value}" if eq else name
            for name, eq, value in pairs
        ]
        parts = parts._replace(query="&".join(hidden))
    return unsplit(parts)


def register(sub: Any) -> None:
    """Add ``migrate``, ``api``, ``dev`` and ``keys`` to the ``reach`` command's subparsers."""
    migrate = sub.add_parser("migrate", help="apply the schema migrations (operator)")
    migrate.set_defaults(handler=_operator(_migrate))
    _json_option(migrate)

    api = sub.add_parser("api", help="serve the API (operator)")
    api.add_argument("--host", default="127.0.0.1", help="the address to listen on")
    api.add_argument("--port", type=_port, default=8000, help="the port (default 8000)")
    api.add_argument(
        "--workers", type=_positive, default=1, help="API processes behind the one port"
    )
    api.set_defaults(handler=_operator(_api))

    dev = sub.add_parser("dev", help="run API, worker, beat and Flower on this machine")
    dev.add_argument("--port", type=_port, default=8000, help="the API's port (default 8000)")
    dev.add_argument("--flower-port", type=_port, default=5555, help="Flower's port (default 5555)")
    dev.set_defaults(handler=_operator(_dev))

    key_cmds = sub.add_parser("keys", help="create, revoke and list API keys (operator)")
    key_sub = key_cmds.add_subparsers(dest="keys_command", required=True)
    create = key_sub.add_parser("create", help="create a key (printed once)")
    create.add_argument("--tenant", required=True)
    create.add_argument("--capabilities", required=True, help="comma-separated, e.g. 'invoice.*'")
    create.add_argument(
        "--tenant-admin",
        action="store_true",
        help="sees all of the tenant's tasks and webhooks, sets its callback secret",
    )
    create.add_argument(
        "--admin", action="store_true", help="operator key: tenant admin, and the infrastructure"
    )
    create.add_argument("--name")
    create.set_defaults(handler=_operator(_keys_create))
    revoke = key_sub.add_parser("revoke", help="revoke a key by its id")
    revoke.add_argument("key_id")
    revoke.set_defaults(handler=_operator(_keys_revoke))
    listing = key_sub.add_parser("list", help="list keys (never their secrets)")
    listing.add_argument("--tenant")
    listing.set_defaults(handler=_operator(_keys_list))
    for command in (create, revoke, listing):
        _json_option(command)


def _json_option(command: argparse.ArgumentParser) -> None:
    """``--json`` after the command, as the user commands take it (before it, the top
    level's): no default here, which would undo the top level's."""
    command.add_argument(
        "--json", action="store_true", default=argparse.SUPPRESS, help="print JSON only"
    )


def _port(value: str) -> int:
    """A TCP port, 1-65535: 99999 was taken modulo 65536 (uvicorn listened on 34463 and said
    99999), -1 was a traceback."""
    try:
        number = int(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a port: {value!r}") from None
    if not 0 < number < 65536:
        raise argparse.ArgumentTypeError(f"a port is 1 to 65535, not {number}")
    return number


def _positive(value: str) -> int:
    number = int(value)
    if number < 1:
        raise argparse.ArgumentTypeError(f"at least 1, not {number}")
    return number


def main(argv: list[str] | None = None) -> int:
    """The whole ``reach`` command (``python -m reach.cli`` runs it too)."""
    from reach_client.cli import main as reach_main

    return reach_main(argv)


if __name__ == "__main__":
    sys.exit(main())
