"""Unit tests for timestamps as the HTTP contract writes them: UTC, ISO 8601, ``Z``."""

from datetime import UTC, datetime, timedelta, timezone

from broker.registry.views import instance_view
from broker.timestamps import iso


def test_given_a_utc_time_expect_iso_text_ending_in_z() -> None:
    assert iso(datetime(2024, 5, 1, 12, 0, 1, 250000, tzinfo=UTC)) == "2024-05-01T12:00:01.250000Z"


def test_given_a_time_in_another_zone_expect_it_written_in_utc() -> None:
    paris = timezone(timedelta(hours=2))
    assert iso(datetime(2024, 5, 1, 14, 0, tzinfo=paris)) == "2024-05-01T12:00:00Z"


def test_given_no_time_expect_none() -> None:
    assert iso(None) is None


def test_given_an_offline_instance_expect_its_times_written_like_a_tasks() -> None:
    # Given an instance with no lease, seen last an hour ago
    started = datetime(2024, 5, 1, 12, 0, tzinfo=UTC)
    row = {
        "instance": "worker-1",
        "hostname": "host",
        "pid": 7,
        "lease_ttl_s": 15,
        "started_at": started,
        "stopped_at": started + timedelta(hours=1),
        "last_seen_at": started + timedelta(hours=1),
        "cards": [],
    }
    # When it is shown
    view = instance_view(row, None, now=(started + timedelta(hours=2)).timestamp())
    # I expect UTC with a Z, as everywhere else in the API
    assert (view["started_at"], view["stopped_at"]) == (
        "2024-05-01T12:00:00Z",
        "2024-05-01T13:00:00Z",
    )
