"""Settings a process would fail on later, refused at start: durations that are no number of
seconds a timer can hold, URLs of no service the broker speaks to, networks mistyped."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from broker.settings import MAX_TTL_S, Settings

DAY_S = 24 * 3600

ENV_NAMES = (
    "REACH_DATABASE_URL",
    "DATABASE_URL",
    "REACH_REDIS_URL",
    "REDIS_URL",
    "REACH_BROKER_URL",
    "REACH_AGENT_NETWORKS",
    "REACH_WEBHOOK_ALLOW",
    "REACH_WEBHOOK_SCHEDULE_S",
)


@pytest.fixture(autouse=True)
def clean_env(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ENV_NAMES:
        monkeypatch.delenv(name, raising=False)


def refusal(monkeypatch: pytest.MonkeyPatch, name: str, value: str) -> str:
    """The error ``Settings()`` raises with ``name`` set to ``value``."""
    monkeypatch.setenv(name, value)
    with pytest.raises(ValidationError) as refused:
        Settings()
    return str(refused.value)


# --- durations -------------------------------------------------------------------------------


@pytest.mark.parametrize("value", ["inf", "-inf", "nan", "Infinity"])
@pytest.mark.parametrize(
    "name",
    ["REACH_REAPER_INTERVAL_S", "REACH_RATE_LIMIT_PER_S", "REACH_LEASE_TTL_S", "REACH_OTHER"],
)
def test_a_number_that_is_not_finite_is_refused(
    monkeypatch: pytest.MonkeyPatch, name: str, value: str
) -> None:
    # Before: `REACH_REAPER_INTERVAL_S=inf celery -A workers beat` failed in Celery
    # (OverflowError) once beat had started.
    if name == "REACH_OTHER":  # a list of floats too
        name, value = "REACH_WEBHOOK_SCHEDULE_S", f"0,{value}"
    assert "finite number" in refusal(monkeypatch, name, value)


@pytest.mark.parametrize(
    ("name", "bound"),
    [
        ("REACH_REAPER_INTERVAL_S", DAY_S),
        ("REACH_JANITOR_INTERVAL_S", DAY_S),
        ("REACH_SWEEP_INTERVAL_S", DAY_S),
        ("REACH_WEBHOOK_SWEEP_INTERVAL_S", DAY_S),
        ("REACH_REMOTE_HEALTH_INTERVAL_S", DAY_S),
        ("REACH_SSE_PING_S", DAY_S),
        ("REACH_CLIENT_STALL_S", DAY_S),
        ("REACH_KEY_CACHE_S", DAY_S),
        ("REACH_DEFAULT_TASK_TIMEOUT_S", MAX_TTL_S),
        ("REACH_LEASE_TTL_S", MAX_TTL_S),
        ("REACH_INSTANCE_RETENTION_S", MAX_TTL_S),
        ("REACH_WEBHOOK_ROTATION_GRACE_S", MAX_TTL_S),
    ],
)
def test_a_duration_is_taken_up_to_its_bound_and_refused_past_it(
    monkeypatch: pytest.MonkeyPatch, name: str, bound: int
) -> None:
    monkeypatch.setenv(name, str(bound))
    field = name.removeprefix("REACH_").lower()
    assert getattr(Settings(), field) == bound
    assert "less than or equal" in refusal(monkeypatch, name, str(bound + 1))


def test_a_webhook_delay_past_the_longest_ttl_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    assert "less than or equal" in refusal(monkeypatch, "REACH_WEBHOOK_SCHEDULE_S", "0,1e12")


# --- service URLs ----------------------------------------------------------------------------


@pytest.mark.parametrize(
    "url",
    [
        "redis://cache:6379/1",
        "rediss://:secret@cache:6380/0",
        "redis+socket:///run/redis.sock",
        "sentinel://sentinel:26379",
        "amqp://guest@rabbit:5672//",
        "amqps://guest@rabbit:5671//",
        "pyamqp://guest@rabbit//",
        "amqp://guest@rabbit-1//;amqp://guest@rabbit-2//",
        "",
    ],
)
def test_a_redis_or_rabbitmq_broker_url_is_taken(monkeypatch: pytest.MonkeyPatch, url: str) -> None:
    monkeypatch.setenv("REACH_BROKER_URL", url)
    assert Settings().broker_url == url


@pytest.mark.parametrize(
    "url", ["foo://", "rabbit", "http://rabbit:5672", "amqp://a//;nope://b", "redis://h:port/0"]
)
def test_a_broker_url_celery_cannot_use_is_refused_at_start(
    monkeypatch: pytest.MonkeyPatch, url: str
) -> None:
    # Before: `foo://` was taken, and every publish failed later with KeyError tracebacks.
    message = refusal(monkeypatch, "REACH_BROKER_URL", url)
    assert "broker_url" in message and "not a Redis (redis://) or RabbitMQ" in message


@pytest.mark.parametrize(
    "url", ["redis://cache:6379/2", "rediss://cache/0", "unix:///tmp/redis.sock?db=3"]
)
def test_a_redis_url_is_taken(monkeypatch: pytest.MonkeyPatch, url: str) -> None:
    monkeypatch.setenv("REDIS_URL", url)
    assert Settings().redis_url == url


@pytest.mark.parametrize("url", ["notaurl", "http://cache:6379", "redis://cache:port/0"])
def test_a_redis_url_that_is_not_one_is_refused_at_start(
    monkeypatch: pytest.MonkeyPatch, url: str
) -> None:
    assert "not a Redis URL" in refusal(monkeypatch, "REACH_REDIS_URL", url)


@pytest.mark.parametrize(
    ("given", "kept"),
    [
        ("postgresql+psycopg://app@db/reach", "postgresql+psycopg://app@db/reach"),
        ("postgres://app:pw@db:5432/reach", "postgresql+psycopg://app:pw@db:5432/reach"),
        # An embedded server's, over its socket.
        (
            "postgresql://postgres:@/postgres?host=/tmp/pg",
            "postgresql+psycopg://postgres:@/postgres?host=/tmp/pg",
        ),
    ],
)
def test_a_postgres_url_is_taken(monkeypatch: pytest.MonkeyPatch, given: str, kept: str) -> None:
    monkeypatch.setenv("DATABASE_URL", given)
    assert Settings().database_url == kept


@pytest.mark.parametrize(
    "url",
    [
        "notaurl",
        "mysql://app:pw@db/reach",
        "postgresql+psycopg2://app@db/reach",
        "postgresql+psycopg://app@db:port/reach",
    ],
)
def test_a_database_url_that_is_not_postgres_is_refused_without_its_password(
    monkeypatch: pytest.MonkeyPatch, url: str
) -> None:
    message = refusal(monkeypatch, "REACH_DATABASE_URL", url)
    assert "REACH_DATABASE_URL" in message and "not a PostgreSQL URL" in message
    assert "pw" not in message


# --- networks and hosts ----------------------------------------------------------------------


@pytest.mark.parametrize("name", ["REACH_AGENT_NETWORKS", "REACH_WEBHOOK_ALLOW"])
def test_addresses_networks_and_host_names_are_taken(
    monkeypatch: pytest.MonkeyPatch, name: str
) -> None:
    entries = "127.0.0.0/8,::1,[::1],fe80::/10,10.0.0.1/8,10.1.2.3,localhost,hooks.example.com."
    monkeypatch.setenv(name, entries)
    assert getattr(Settings(), name.removeprefix("REACH_").lower()) == entries.split(",")


@pytest.mark.parametrize("name", ["REACH_AGENT_NETWORKS", "REACH_WEBHOOK_ALLOW"])
@pytest.mark.parametrize(
    "entry", ["300.1.1.1/8", "10.0.0/8", "not/a/net", "10.0.0", "1::2::3", "-bad-.example", "a..b"]
)
def test_a_mistyped_network_or_host_fails_at_start_naming_it(
    monkeypatch: pytest.MonkeyPatch, name: str, entry: str
) -> None:
    # Before: the guard kept it as a host name no URL can carry; it allowed nothing, and
    # callers saw `url_not_allowed` with no hint why.
    message = refusal(monkeypatch, name, f"127.0.0.0/8,{entry},localhost")
    assert repr(entry) in message
    assert "'127.0.0.0/8'" not in message and "'localhost'" not in message
