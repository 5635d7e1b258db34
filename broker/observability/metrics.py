"""Prometheus metrics. Names follow the conventions: ``reach_..._total`` for counters,
``_seconds`` for durations.

The API process exposes them at ``/metrics``. Celery's prefork workers run tasks in child
processes, so the workers use prometheus-client's multiprocess mode (``PROMETHEUS_MULTIPROC_DIR``
set before this module is imported, see ``workers``) and their main process serves the merged
view on ``REACH_WORKER_METRICS_PORT``. ``reach api --workers N`` does the same for its API
processes, each of which serves the merged view.

The system gauges are computed alike by every API process (``api.system_gauges``): merged,
the freshest figure stands for them all (``mostrecent``).
"""

from __future__ import annotations

import os
from typing import Any, TypeVar

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, multiprocess
from prometheus_client.metrics import MetricWrapperBase

M = TypeVar("M", bound=MetricWrapperBase)

LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)
RUN_BUCKETS = (0.01, 0.05, 0.1, 0.5, 1, 5, 15, 60, 300, 900, 3600)

# The API.
http_requests = Counter(
    "reach_http_requests_total", "HTTP requests answered", ["method", "route", "status"]
)
http_duration = Histogram(
    "reach_http_request_duration_seconds",
    "HTTP request latency",
    ["method", "route"],
    buckets=LATENCY_BUCKETS,
)
submit_duration = Histogram(
    "reach_submit_duration_seconds",
    "POST /tasks, from request to the task accepted",
    buckets=LATENCY_BUCKETS,
)
sync_round_trip = Histogram(
    "reach_sync_round_trip_seconds",
    "reply_mode sync: request to the answer",
    buckets=LATENCY_BUCKETS,
)
stream_first_event = Histogram(
    "reach_stream_first_event_seconds",
    "SSE: request to the first event frame",
    buckets=LATENCY_BUCKETS,
)
routing_failures = Counter(
    "reach_routing_failures_total",
    "Requests no live agent could serve (no_agent_available)",
    ["capability"],
)
rejections = Counter("reach_rejections_total", "Requests refused by back-pressure", ["reason"])
idempotency = Counter(
    "reach_idempotency_total", "Idempotency keys seen again", ["outcome"]
)  # replayed | conflict
queue_depth = Gauge(
    "reach_queue_depth",
    "Messages waiting per capability queue",
    ["capability"],
    multiprocess_mode="mostrecent",
)
queue_oldest_age = Gauge(
    "reach_queue_oldest_age_seconds",
    "Age of the oldest queued task per capability",
    ["capability"],
    multiprocess_mode="mostrecent",
)
registry_ready = Gauge(
    "reach_registry_ready_instances",
    "Instances holding a ready lease",
    multiprocess_mode="mostrecent",
)
registry_registered = Gauge(
    "reach_registry_registered_instances",
    "Instances known to the registry (any state but offline)",
    multiprocess_mode="mostrecent",
)
system_gauges_refreshed = Gauge(
    "reach_system_gauges_refreshed_timestamp_seconds",
    "When this API process last computed the queue and registry gauges (Unix time)",
    multiprocess_mode="mostrecent",
)

# The workers.
tasks_finished = Counter(
    "reach_tasks_finished_total", "Tasks that reached a final state", ["capability", "status"]
)
task_run = Histogram(
    "reach_task_run_seconds", "Handler run time", ["capability"], buckets=RUN_BUCKETS
)
task_retries = Counter("reach_task_retries_total", "Attempts that will run again", ["capability"])
heartbeat_failures = Counter("reach_heartbeat_failures_total", "Lease renewals that failed")
lost_tasks = Counter(
    "reach_lost_tasks_total", "Tasks whose worker died while running them", ["outcome"]
)  # requeued | failed
webhook_attempts = Counter("reach_webhook_attempts_total", "Webhook delivery attempts", ["outcome"])
runs_set_aside = Counter(
    "reach_runs_set_aside_total",
    "Run messages a worker put back behind the others: their tenant held its share of its slots",
)


def shared() -> bool:
    """Whether this process counts in a folder it shares with others (multiprocess mode)."""
    return "PROMETHEUS_MULTIPROC_DIR" in os.environ


def merged_registry() -> CollectorRegistry:
    """The merged view of every process counting in this process's folder (multiprocess
    mode): a worker and its pool, or the API processes of one ``reach api --workers N``."""
    registry = CollectorRegistry()
    path = os.environ["PROMETHEUS_MULTIPROC_DIR"]
    multiprocess.MultiProcessCollector(registry, path=path)  # type: ignore[no-untyped-call]
    return registry


_children: dict[tuple[Any, tuple[str, ...]], Any] = {}


def labelled(metric: M, *values: str) -> M:
    """``metric.labels(*values)``, kept for the next time: prometheus-client checks the
    values and takes a lock on each ``labels``, which the hot paths call for every request
    and task. Only for label values from a bounded set: each is kept for the process's life,
    as prometheus-client keeps its series."""
    key = (metric, values)
    child = _children.get(key)
    if child is None:
        child = _children[key] = metric.labels(*values)
    return child
