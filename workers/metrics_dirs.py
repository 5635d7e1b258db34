"""The folder each ``celery -A workers`` process keeps its metrics in
(``broker.observability.metrics_dirs``), held again after Celery's ``--detach``."""

from __future__ import annotations

from celery import signals

from broker.observability.metrics_dirs import choose, hold_again


def prepare() -> None:
    """Choose the folder before prometheus-client's metrics are made, and take its lock again
    when a worker or beat starts: beat's ``--detach`` forks in process and closes every file."""
    choose()
    signals.worker_init.connect(hold_again, weak=False)
    signals.beat_init.connect(hold_again, weak=False)
