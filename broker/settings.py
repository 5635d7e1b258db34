"""Settings, read from the environment by the composition roots and passed in.

Nothing here is read at import: ``Settings()`` is built by ``api.app.create_app``'s caller,
the Celery app factory and the CLI.
"""

from __future__ import annotations

import re
from ipaddress import ip_network
from typing import Annotated
from urllib.parse import urlsplit

from pydantic import AliasChoices, Field, SecretStr, field_validator
from pydantic_settings import BaseSettings, NoDecode, SettingsConfigDict
from sqlalchemy.engine import make_url
from sqlalchemy.exc import ArgumentError

from broker.runtime import EventLoopKind

MiB = 1024 * 1024
# The longest any TTL may be: ten years. TTLs are kept as 4-byte integers and a claim holds a
# task for its TTL plus six hours in that arithmetic: a TTL near 2**31 ("keep it for ever")
# made every claim fail with an integer overflow.
MAX_TTL_S = 10 * 365 * 24 * 3600
# The longest any interval, cache or network timeout may be. A value Celery or asyncio cannot
# hold as a time (``inf``, 1e300) failed deep in them instead of at start.
DAY_S = 24 * 3600

# What Celery may use as its broker: Redis (its socket and Sentinel forms too) or RabbitMQ.
BROKER_SCHEMES = ("redis", "rediss", "redis+socket", "sentinel", "amqp", "amqps", "pyamqp")
REDIS_SCHEMES = ("redis", "rediss", "unix")
# A host name of RFC 1123 labels (and '_', which URLs carry too; ``broker.webhooks.ssrf``).
_LABEL = r"[a-z0-9_](?:[a-z0-9_-]{0,61}[a-z0-9])?"
_HOSTNAME = re.compile(rf"(?:{_LABEL}\.)*{_LABEL}")


def psycopg_url(url: str) -> str:
    """``url`` with the driver this project installs: the ``postgres://`` and
    ``postgresql://`` most hosts hand out would make SQLAlchemy look for psycopg2."""
    scheme, separator, rest = url.partition("://")
    if separator and scheme in ("postgres", "postgresql"):
        return f"postgresql+psycopg://{rest}"
    return url


class Settings(BaseSettings):
    # No inf or nan: a duration that is not a number passed here and broke the first timer.
    # A refused value is not repeated in the error: it may be a password or a token.
    model_config = SettingsConfigDict(
        env_prefix="REACH_", extra="ignore", allow_inf_nan=False, hide_input_in_errors=True
    )

    database_url: str = Field(
        "postgresql+psycopg://postgres@127.0.0.1:5432/reach",
        validation_alias=AliasChoices("REACH_DATABASE_URL", "DATABASE_URL"),
    )
    redis_url: str = Field(
        "redis://127.0.0.1:6379/0",
        validation_alias=AliasChoices("REACH_REDIS_URL", "REDIS_URL"),
    )
    # The Celery broker; Redis by default, RabbitMQ (amqp://) works too.
    broker_url: str | None = None
    # RabbitMQ's consumer_timeout (a server setting, 30 min by default): a delivery unacked that
    # long closes its channel and requeues all it holds. Read only with an amqp:// broker.
    broker_consumer_timeout_s: float = Field(1800.0, gt=0)

    # Modules whose import registers agents with ``@agent.capability``.
    agents: Annotated[list[str], NoDecode] = ["workers.examples"]

    result_ttl_s: int = Field(24 * 3600, gt=0, le=MAX_TTL_S)
    max_result_ttl_s: int = Field(7 * 24 * 3600, gt=0, le=MAX_TTL_S)
    max_payload_bytes: int = Field(1 * MiB, gt=0)
    # A task's metadata, as canonical JSON. It goes out with every final event, kept in Redis
    # as long as the result, and every webhook body: a tenant's cancelled submits alone, no
    # agent needed, put 52 MiB in Redis in 6 s with 120 KiB of metadata each.
    max_metadata_bytes: int = Field(16 * 1024, gt=0)
    max_json_depth: int = Field(32, gt=0, le=500)
    # What one tenant's tasks, sessions and webhook deliveries may hold in Postgres: their
    # payloads, their metadata and a KiB a task; its sessions' state, metadata and
    # revisions, a KiB each; its deliveries' URLs and a KiB each and per attempt
    # (``broker.tenancy.usage``), until they expire. Past it a submit, or a session's
    # creation or write, is 429 ``quota_exceeded``. Without it a tenant held its rate times
    # the TTL times a payload: 200 tasks/s of 1 MiB for a day is 17 TB, every tenant's disk.
    tenant_max_held_bytes: int = Field(10 * 1024 * MiB, gt=0)
    # What one tenant's event logs may hold in Redis, the broker's memory: the events its
    # agents streamed and the final ones, which carry the results, until they expire. Past it
    # a submit is 429 ``quota_exceeded`` too. Without it an ``echo`` of 1 MiB payloads put
    # the tenant's whole Postgres quota in Redis.
    tenant_max_event_bytes: int = Field(1024 * MiB, gt=0)
    # What an agent sends back: a result past this many bytes of JSON fails its task
    # (``result_too_large``); a task's event log keeps at most this many bytes, its oldest
    # events giving way, and refuses one event larger (``events_too_large``). A final event and
    # every webhook body carry the result, kept in Redis and Postgres as long as the task;
    # unbounded, one agent's answers could fill Redis for every tenant. At least 64 KiB, so
    # the broker's own status events (a few hundred bytes) always fit.
    max_result_bytes: int = Field(4 * MiB, gt=0)
    event_log_max_bytes: int = Field(4 * MiB, ge=64 * 1024)
    list_page_max: int = Field(100, gt=0)
    # ... and at most this many bytes of the JSON its rows carry (a session's state, a task's
    # result...), so one request cannot make the API read and send a hundred large values.
    # A page ends before the row that would pass it, and always holds one row.
    list_page_max_bytes: int = Field(1 * MiB, gt=0)

    janitor_interval_s: float = Field(60.0, gt=0, le=DAY_S)
    janitor_batch: int = Field(1000, gt=0)
    # One janitor run deletes batches until no expired row is left or this is spent; it holds
    # one maintenance process meanwhile, so the reaper keeps the other.
    janitor_budget_s: float = Field(10.0, gt=0, le=DAY_S)
    # An instance's row (``GET /agents``) is kept this long after it was last seen live, then
    # the janitor deletes it: every worker name ever used stayed listed offline forever.
    instance_retention_s: float = Field(86400.0, gt=0, le=MAX_TTL_S)
    # Tasks of dead workers are found this often; queued tasks the broker lost are published
    # again once they are sweep_after_s old and their message is not in their queue.
    reaper_interval_s: float = Field(5.0, gt=0, le=DAY_S)
    sweep_interval_s: float = Field(10.0, gt=0, le=DAY_S)
    sweep_after_s: float = Field(30.0, gt=0, le=DAY_S)
    # A handler whose card sets no timeout_s gets this one; the hard limit adds a grace.
    default_task_timeout_s: float = Field(600.0, gt=0, le=MAX_TTL_S)

    # Overrides every card's lease TTL (tests and operators shorten it); None: the cards' own.
    lease_ttl_s: float | None = Field(None, gt=0, le=MAX_TTL_S)
    # How long the API trusts a card's input schema and the measured success rates it read.
    card_cache_s: float = Field(5.0, ge=0, le=DAY_S)
    # How long a tenant's figures (GET /capabilities) and series answer again as computed.
    figures_cache_s: float = Field(5.0, ge=0, le=DAY_S)

    # reply_mode sync waits at most this long (and never past the task's deadline).
    sync_max_wait_s: float = Field(30.0, gt=0, le=300)
    # An MCP tool call waits this long for its task; after it, it answers with the task's id
    # and status for the model to poll (an MCP host's own request timeout is often 60 s).
    mcp_wait_s: float = Field(20.0, gt=0, le=300)
    # The Host names /mcp answers to (``name`` or ``name:*`` for any port), against DNS
    # rebinding; empty: any, since every call must carry a bearer key a page cannot forge.
    mcp_allowed_hosts: Annotated[list[str], NoDecode] = []
    # The API's address as its callers reach it (https://reach.example.com): the A2A cards
    # name their endpoints under it. Unset, they are named under the request's own Host, and
    # the public card is sent with Cache-Control: no-store, so no shared cache keeps a card a
    # forged Host made (one that sent every client's key elsewhere).
    public_url: str | None = None
    # SSE: a ': ping' after this much silence; a client not reading for send_timeout is dropped.
    sse_ping_s: float = Field(15.0, gt=0, le=DAY_S)
    sse_send_timeout_s: float = Field(30.0, gt=0, le=DAY_S)
    # Any answer: a client that takes less than 16 KiB of it in this long while the rest waits
    # in the API process is disconnected (``api.connections``).
    client_stall_s: float = Field(30.0, gt=0, le=DAY_S)
    # Streams one tenant may hold open at once in one API process (SSE, A2A streams); past it,
    # 429 too_many_streams before anything is written. Each holds a connection and memory: one
    # tenant opening thousands would take the process's file descriptors from every other.
    max_streams_per_tenant: int = Field(1000, gt=0)

    # Back-pressure: per tenant, tasks per second with a burst; per queue, waiting messages.
    rate_limit_per_s: float = Field(200.0, gt=0)
    rate_limit_burst: int = Field(400, gt=0)
    max_queue_depth: int = Field(10_000, gt=0)
    # Requests of any kind (reads, streams, A2A and MCP calls too) per tenant and API process,
    # with a burst of twice that; past it, 429 rate_limited before any query. Reads take no
    # task token, and a cheap read flooded from many connections (a 404 costs one indexed
    # query) took the process from every other tenant.
    request_rate_per_s: float = Field(1000.0, gt=0)
    # Once a queue holds this share of max_queue_depth, a tenant holding that many of its
    # waiting tasks gets 429 too_many_queued: one tenant within its rate cannot fill a queue
    # every tenant shares (1: no share, first come first served up to the bound).
    max_queue_share: float = Field(0.5, gt=0, le=1)
    # Once a queue holds this many messages, a tenant with this many of its tasks waiting in
    # it has its next ones queued behind every other tenant's (with a Redis broker; 0: first
    # come, first served): another tenant's task waits behind at most this many of its.
    queue_fair_slice: int = Field(100, ge=0)
    # The most of a threads-pool worker's slots (its -c, rounded up) one tenant's runs hold at
    # once; the rest stay free for the other tenants' (with a Redis broker; 1: no share). One
    # tenant's slow calls (an agent it makes wait, up to the timeout) took every slot of a
    # bridge or an async worker, and every tenant's calls waited.
    max_slots_share: float = Field(0.9, gt=0, le=1)
    # Requests of one API process waiting for their answer (sync waits too); beyond it, 503 at
    # once. 1,000 connections submitting at once all fit and are answered within seconds.
    max_requests_waiting: int = Field(1024, gt=0)
    # ... of which one tenant may hold at most this many, so one client's slow bodies or long
    # sync waits never leave the others nothing but 503s.
    max_requests_waiting_per_tenant: int = Field(256, gt=0)
    # A request body must have arrived whole within this long (408 otherwise): a body sent a
    # byte at a time holds its waiting slot no longer.
    body_read_timeout_s: float = Field(10.0, gt=0, le=DAY_S)
    # Key ids not found in the API's memory are looked up in Postgres at most this often per
    # client address (with twice that as a burst); past it, 429 without a query.
    auth_lookups_per_s: float = Field(20.0, gt=0)
    # Host names of webhook and callback URLs are resolved in threads of their own (never the
    # pool the API's other work shares), each lookup bounded in time, at most a few of one
    # tenant at once: a name server that never answers holds that tenant's lookups only.
    dns_timeout_s: float = Field(2.0, gt=0, le=30)
    dns_threads: int = Field(16, gt=0, le=256)
    dns_lookups_per_tenant: int = Field(2, gt=0)

    # Each worker serves its metrics here (0: not at all); a busy port is logged and skipped.
    worker_metrics_port: int = Field(9808, ge=0, le=65535)

    # OpenTelemetry (the `otel` extra): spans for FastAPI and Celery, our trace id as theirs.
    otel: bool = False

    # How long a key lookup may be served from the API's memory; revocation takes this long.
    key_cache_s: float = Field(5.0, ge=0, le=DAY_S)

    # Webhooks. Hosts, addresses or networks a webhook may reach despite the SSRF deny table
    # (development and tests; production allows none). The schedule is the delay before each
    # attempt: its length is the number of attempts, then the message is dead.
    webhook_allow: Annotated[list[str], NoDecode] = []
    webhook_schedule_s: Annotated[list[Annotated[float, Field(ge=0, le=MAX_TTL_S)]], NoDecode] = (
        Field([0, 5, 300, 1800, 7200, 18000, 36000, 36000], min_length=1)
    )
    webhook_jitter: float = Field(0.2, ge=0, le=1)
    webhook_timeout_s: float = Field(15.0, gt=0, le=60)
    webhook_response_max_bytes: int = Field(64 * 1024, gt=0)
    webhook_rotation_grace_s: int = Field(24 * 3600, ge=0, le=MAX_TTL_S)
    webhook_delivery_ttl_s: int = Field(7 * 24 * 3600, gt=0, le=MAX_TTL_S)
    webhook_sweep_interval_s: float = Field(30.0, gt=0, le=DAY_S)
    webhook_max_per_tenant: int = Field(50, gt=0)

    # Hostile tenants. A tenant's attempts in flight at once, over all webhooks workers; its
    # other due ones wait in Postgres (parked) until one of them ends and releases the next,
    # so other tenants' go on. The webhooks worker needs more processes than this
    # (docker-compose runs 8).
    webhook_max_inflight_per_tenant: int = Field(4, gt=0)

    # Sessions: the idle TTL a new one gets (every write extends it), its ceiling, the most
    # its state and metadata may hold together, and the most live ones a tenant may hold
    # (409 session_limit_reached beyond it), so one tenant cannot fill the table.
    session_ttl_s: int = Field(24 * 3600, gt=0, le=MAX_TTL_S)
    session_max_ttl_s: int = Field(30 * 24 * 3600, gt=0, le=MAX_TTL_S)
    session_max_bytes: int = Field(256 * 1024, gt=0)
    session_max_per_tenant: int = Field(10_000, gt=0)
    # The revisions kept of each session (GET /sessions/{id}/revisions): a write deletes the
    # ones older than this many, so a session's history is bounded however often it is
    # written; without it, each write kept a copy of up to session_max_bytes for good.
    session_revisions_kept: int = Field(20, gt=0)
    # The turns one session may hold unfinished (queued or running); one more is 429
    # session_turns_exceeded. A waiting turn's message is dropped by the worker, so no queue
    # bound counts it: without this a session took turns without end, a row each.
    session_max_unfinished_turns: int = Field(100, gt=0)

    # Remote agents (PUT /agents/{agent_id}). Their endpoints are registered by operators and
    # may be internal: the networks listed here may be reached, besides public addresses; the
    # rest of the SSRF deny table (link-local and cloud metadata, reserved ranges) stays shut.
    agent_networks: Annotated[list[str], NoDecode] = [
        "127.0.0.0/8",
        "::1/128",
        "10.0.0.0/8",
        "172.16.0.0/12",
        "192.168.0.0/16",
        "fc00::/7",
    ]
    # The bridge: health checks every interval, all at once, each (connect, headers, body)
    # within its timeout, on a loop of their own whose name lookups take remote_health_threads
    # threads; an agent goes offline after remote_fail_after failures in a row and comes back
    # after remote_recover_after_s and remote_recover_passes passes in a row.
    remote_health_interval_s: float = Field(5.0, gt=0, le=DAY_S)
    remote_health_timeout_s: float = Field(2.0, gt=0, le=30)
    remote_health_threads: int = Field(4, gt=0, le=64)
    remote_fail_after: int = Field(5, gt=0)
    remote_recover_passes: int = Field(5, gt=0)
    remote_recover_after_s: float = Field(60.0, ge=0, le=DAY_S)
    remote_lease_ttl_s: float = Field(30.0, gt=0, le=MAX_TTL_S)
    # A call whose answer has not begun within this is retried (a first-byte timeout).
    remote_first_byte_timeout_s: float = Field(30.0, gt=0, le=DAY_S)

    # /metrics. Each API process computes the system gauges (queue depths, the oldest queued
    # task, registry health) every metrics_refresh_s and serves the last figures; a scrape
    # reads no database. With a token, /metrics needs ``Authorization: Bearer <token>``;
    # without one it answers 404 unless metrics_public (the dev stack sets it); a token under
    # 16 characters is refused at startup. The workers' metrics server (worker_metrics_port)
    # listens on worker_metrics_host.
    metrics_token: SecretStr | None = Field(None, min_length=16)
    metrics_public: bool = False
    # /docs and /redoc: FastAPI's pages, which load Swagger UI and ReDoc from jsDelivr, a
    # script of another origin on this one (where the console keeps its key in the tab).
    # Off: both 404; /openapi.json stays.
    api_docs: bool = True
    metrics_refresh_s: float = Field(15.0, gt=0, le=DAY_S)
    worker_metrics_host: str = "127.0.0.1"

    # The API and worker processes collect the garbage collector's youngest generation every
    # this many net allocations (0: Python's 700); see broker.runtime.
    gc_gen0_threshold: int = Field(10_000, ge=0)
    # The event loop a worker runs async handlers on: uvloop (asyncio's where it is not
    # installed), or asyncio's own; see broker.runtime.
    event_loop: EventLoopKind = "uvloop"

    @field_validator(
        "agents",
        "webhook_allow",
        "webhook_schedule_s",
        "agent_networks",
        "mcp_allowed_hosts",
        mode="before",
    )
    @classmethod
    def _split_modules(cls, value: object) -> object:
        if isinstance(value, str):
            return [m.strip() for m in value.split(",") if m.strip()]
        return value

    @field_validator("database_url")
    @classmethod
    def _psycopg_driver(cls, value: str) -> str:
        value = psycopg_url(value)
        try:
            drivername = make_url(value).drivername
        except (ArgumentError, ValueError):  # ValueError: a port that is not a number
            drivername = None
        if drivername != "postgresql+psycopg":
            raise ValueError(
                f"not a PostgreSQL URL ({_scheme(value)}): postgresql+psycopg://user@host/db,"
                " or postgresql:// or postgres://"
            )
        return value

    @field_validator("redis_url")
    @classmethod
    def _a_redis_url(cls, value: str) -> str:
        _check_url(value, REDIS_SCHEMES, "a Redis URL (redis://host:6379/0, rediss://, unix://)")
        return value

    @field_validator("broker_url")
    @classmethod
    def _a_broker_url(cls, value: str | None) -> str | None:
        if not value:  # unset or empty: the Redis URL
            return value
        # Kombu takes several URLs separated by ';' and fails over between them.
        for url in value.split(";"):
            _check_url(url.strip(), BROKER_SCHEMES, "a Redis (redis://) or RabbitMQ (amqp://) URL")
        return value

    @field_validator("agent_networks", "webhook_allow")
    @classmethod
    def _networks_or_hosts(cls, value: list[str]) -> list[str]:
        refused = [reason for reason in map(_refused_entry, value) if reason]
        if refused:
            raise ValueError("; ".join(refused))
        return value

    @field_validator("public_url")
    @classmethod
    def _an_origin(cls, value: str | None) -> str | None:
        if value is None:
            return None
        parts = urlsplit(value)
        try:
            parts.port  # noqa: B018 (raises on a port that is not a number)
        except ValueError as exc:
            raise ValueError(f"public_url {value!r}: {exc}") from None
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ValueError(f"public_url {value!r} is not http(s)://host[:port][/path]")
        if parts.query or parts.fragment or parts.username or parts.password:
            raise ValueError(f"public_url {value!r}: no query, fragment or credentials")
        return value.rstrip("/")

    @property
    def celery_broker_url(self) -> str:
        return self.broker_url or self.redis_url

    @property
    def max_body_bytes(self) -> int:
        """The payload limit plus room for the rest of the envelope."""
        return self.max_payload_bytes + 64 * 1024


def _check_url(url: str, schemes: tuple[str, ...], what: str) -> None:
    # The messages name the scheme only: the rest of a URL may hold a password.
    try:
        parts = urlsplit(url)
        parts.port  # noqa: B018 (raises on a port that is not a number)
    except ValueError as exc:
        raise ValueError(f"not {what}: {exc}") from None
    if parts.scheme not in schemes or "://" not in url:
        raise ValueError(f"not {what} ({_scheme(url)})")


def _scheme(url: str) -> str:
    scheme, separator, _ = url.partition("://")
    return f"scheme {scheme}://" if separator else "no scheme://"


def _refused_entry(entry: str) -> str | None:
    """Why ``entry`` is neither an address or network as ``broker.webhooks.ssrf.Guard`` reads
    one, nor a host name; None when it is one. The guard takes anything else for a host name
    no URL can carry: a mistyped network (``10.0.0/8``) allowed nothing, and nothing said so."""
    text = entry.strip().lower().rstrip(".")
    try:
        ip_network(text.strip("[]"), strict=False)
        return None
    except ValueError:
        pass
    if "/" in text or ":" in text or "[" in text or not text.strip("0123456789."):
        return f"{entry!r} is not an IP address or network"
    if len(text) > 253 or not _HOSTNAME.fullmatch(text):
        return f"{entry!r} is neither an IP address, a network nor a host name"
    return None
