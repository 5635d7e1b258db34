"""``bench.stats.RoundTrips``: the waited series, then the instant one, each in a figure of its
own, the delay subtracted only from the waited calls."""

from __future__ import annotations

from bench.stats import RoundTrips


def test_the_waited_calls_all_come_before_the_instant_ones() -> None:
    assert list(RoundTrips.series(3)) == [
        (0, False),
        (1, False),
        (2, False),
        (0, True),
        (1, True),
        (2, True),
    ]


def test_the_delay_is_taken_off_the_waited_calls_only() -> None:
    trips = RoundTrips(delay_s=1000.0)
    for _, instant in trips.series(2):
        with trips.timed(instant=instant):
            pass
    figures = trips.figures()
    assert figures["added_latency"]["samples"] == figures["added_latency_instant"]["samples"] == 2
    # an empty block less a delay of 1,000 s, against an empty block
    assert figures["added_latency"]["p50_ms"] < -999_000
    assert figures["added_latency_instant"]["p50_ms"] >= 0


def test_a_series_not_made_has_no_figure() -> None:
    trips = RoundTrips(delay_s=0.5)
    assert trips.figures() == {}
