"""``broker.observability.metrics.labelled``: prometheus-client's labelled series, kept."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter

from broker.observability import metrics


def test_a_labelled_series_is_kept_and_counts_as_labels_would() -> None:
    counter = Counter("t_total", "a test counter", ["capability", "status"], registry=None)
    first = metrics.labelled(counter, "echo", "succeeded")
    assert metrics.labelled(counter, "echo", "succeeded") is first
    assert first is counter.labels("echo", "succeeded")
    other = metrics.labelled(counter, "echo", "failed")
    assert other is not first
    first.inc()
    first.inc()
    other.inc()
    registry = CollectorRegistry()
    registry.register(counter)
    assert registry.get_sample_value("t_total", {"capability": "echo", "status": "succeeded"}) == 2
    assert registry.get_sample_value("t_total", {"capability": "echo", "status": "failed"}) == 1
