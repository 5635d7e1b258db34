"""Unit tests for settings read from the environment."""

import pytest
from pydantic import ValidationError

from broker.settings import MAX_TTL_S, Settings

ENV_NAMES = (
    "REACH_AGENTS",
    "REACH_DATABASE_URL",
    "DATABASE_URL",
    "REACH_REDIS_URL",
    "REDIS_URL",
    "REACH_BROKER_URL",
    "REACH_MAX_PAYLOAD_BYTES",
    "REACH_LIST_PAGE_MAX_BYTES",
    "REACH_METRICS_TOKEN",
    "REACH_METRICS_PUBLIC",
    "REACH_METRICS_REFRESH_S",
    "REACH_WORKER_METRICS_HOST",
)


@pytest.fixture(autouse=True)
def clean_env(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ENV_NAMES:
        monkeypatch.delenv(name, raising=False)


# --- REACH_AGENTS --------------------------------------------------------------------------


def test_given_no_agents_variable_expect_the_example_agents() -> None:
    assert Settings().agents == ["workers.examples"]


@pytest.mark.parametrize(
    ("value", "modules"),
    [
        ("workers.examples", ["workers.examples"]),
        ("workers.examples,tests.agents", ["workers.examples", "tests.agents"]),
        (" a.b , c ,, d ,", ["a.b", "c", "d"]),
        ("", []),
        (" , ", []),
    ],
)
def test_given_a_comma_list_of_agent_modules_expect_a_trimmed_list(
    monkeypatch: pytest.MonkeyPatch, value: str, modules: list[str]
) -> None:
    monkeypatch.setenv("REACH_AGENTS", value)
    assert Settings().agents == modules


# --- database and broker URLs --------------------------------------------------------------


def test_given_only_database_url_expect_it_used(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("DATABASE_URL", "postgresql+psycopg://plain@db/plain")
    assert Settings().database_url == "postgresql+psycopg://plain@db/plain"


@pytest.mark.parametrize(
    "given",
    ["postgres://app:pw@db:5432/reach", "postgresql://app:pw@db:5432/reach"],
)
def test_given_a_conventional_postgres_url_expect_the_psycopg_driver_named(
    monkeypatch: pytest.MonkeyPatch, given: str
) -> None:
    # A plain postgresql:// makes SQLAlchemy import psycopg2, which is not installed.
    monkeypatch.setenv("DATABASE_URL", given)
    assert Settings().database_url == "postgresql+psycopg://app:pw@db:5432/reach"


def test_given_reach_database_url_and_database_url_expect_reach_to_win(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("DATABASE_URL", "postgresql+psycopg://plain@db/plain")
    monkeypatch.setenv("REACH_DATABASE_URL", "postgresql+psycopg://reach@db/reach")
    assert Settings().database_url == "postgresql+psycopg://reach@db/reach"


def test_given_redis_url_alias_expect_it_used(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("REDIS_URL", "redis://cache:6379/2")
    assert Settings().redis_url == "redis://cache:6379/2"


def test_given_no_broker_url_expect_the_celery_broker_to_be_the_redis_url(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("REACH_REDIS_URL", "redis://cache:6379/3")
    settings = Settings()
    assert settings.broker_url is None
    assert settings.celery_broker_url == "redis://cache:6379/3"


def test_given_a_broker_url_expect_it_used_for_celery(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("REACH_BROKER_URL", "amqp://guest@rabbit:5672//")
    assert Settings().celery_broker_url == "amqp://guest@rabbit:5672//"


# --- size limits ---------------------------------------------------------------------------


def test_given_default_limits_expect_the_body_limit_above_the_payload_limit() -> None:
    settings = Settings()
    assert settings.max_body_bytes > settings.max_payload_bytes


def test_given_a_payload_limit_from_the_env_expect_the_body_limit_to_follow(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("REACH_MAX_PAYLOAD_BYTES", "1000")
    settings = Settings()
    assert settings.max_payload_bytes == 1000
    assert settings.max_body_bytes > 1000


def test_given_a_page_byte_budget_from_the_env_expect_it_used_and_a_mebibyte_without(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    assert Settings().list_page_max_bytes == 1024 * 1024
    monkeypatch.setenv("REACH_LIST_PAGE_MAX_BYTES", "4096")
    assert Settings().list_page_max_bytes == 4096
    monkeypatch.setenv("REACH_LIST_PAGE_MAX_BYTES", "0")
    with pytest.raises(ValidationError):
        Settings()


def test_given_an_event_log_budget_below_64_kib_expect_it_refused(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Below it a status event of the broker's own could be refused: a submit would fail."""
    assert Settings().event_log_max_bytes == 4 * 1024 * 1024
    monkeypatch.setenv("REACH_EVENT_LOG_MAX_BYTES", str(64 * 1024))
    assert Settings().event_log_max_bytes == 64 * 1024
    monkeypatch.setenv("REACH_EVENT_LOG_MAX_BYTES", str(64 * 1024 - 1))
    with pytest.raises(ValidationError):
        Settings()


def test_given_a_short_or_empty_metrics_token_expect_it_refused(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    for short in ("", "a" * 15):
        monkeypatch.setenv("REACH_METRICS_TOKEN", short)
        with pytest.raises(ValidationError):
            Settings()
    monkeypatch.setenv("REACH_METRICS_TOKEN", "a" * 16)
    token = Settings().metrics_token
    assert token is not None and token.get_secret_value() == "a" * 16


def test_given_no_metrics_settings_expect_metrics_closed_and_workers_on_loopback() -> None:
    settings = Settings()
    assert (settings.metrics_token, settings.metrics_public) == (None, False)
    assert settings.worker_metrics_host == "127.0.0.1"
    assert settings.metrics_refresh_s == 15.0


# --- the bridge's clocks ---------------------------------------------------------------------


def test_a_killed_agent_goes_offline_within_the_lease_ttl_by_default() -> None:
    """A killed agent refuses each health check at once, so the bridge takes it offline (and
    routing answers 503) after ``remote_fail_after`` ticks, one ``remote_health_interval_s``
    apart: by default before its lease would have run out (issue 15's "within the lease
    TTL"); ``test_remote_agents.py`` shows it happen with the tests' faster clocks."""
    defaults = Settings()
    ticks_s = defaults.remote_fail_after * defaults.remote_health_interval_s
    assert ticks_s < defaults.remote_lease_ttl_s


@pytest.mark.parametrize(
    "name", ["result_ttl_s", "max_result_ttl_s", "session_ttl_s", "session_max_ttl_s"]
)
def test_a_ttl_past_ten_years_is_refused_at_start_not_by_every_claim(name: str) -> None:
    """A TTL near 2**31 seconds passed the settings, and every claim's hold (its TTL plus six
    hours, 4-byte integers) then overflowed."""
    assert Settings(**{name: MAX_TTL_S}).model_dump()[name] == MAX_TTL_S
    with pytest.raises(ValidationError):
        Settings(**{name: 2**31 - 1})


@pytest.mark.parametrize(
    ("given", "kept"),
    [
        ("https://reach.example.com", "https://reach.example.com"),
        ("https://reach.example.com:8443/base/", "https://reach.example.com:8443/base"),
        ("http://10.0.0.7:8000/", "http://10.0.0.7:8000"),
    ],
)
def test_a_public_url_is_kept_without_its_last_slash(
    monkeypatch: pytest.MonkeyPatch, given: str, kept: str
) -> None:
    monkeypatch.setenv("REACH_PUBLIC_URL", given)
    assert Settings().public_url == kept


@pytest.mark.parametrize(
    "given",
    [
        "reach.example.com",
        "ftp://reach.example.com",
        "https://",
        "https://reach.example.com:80a0",
        "https://reach.example.com/?x=1",
        "https://user:pw@reach.example.com",
    ],
)
def test_a_public_url_that_is_no_http_origin_is_refused_at_start(
    monkeypatch: pytest.MonkeyPatch, given: str
) -> None:
    monkeypatch.setenv("REACH_PUBLIC_URL", given)
    with pytest.raises(ValidationError, match="public_url"):
        Settings()
