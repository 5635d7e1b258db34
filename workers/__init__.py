"""Agent-Reach workers: ``celery -A workers worker -Q <capability>``.

Agents import the SDK from here: ``from workers import agent, Context, AgentFailure``.
The Celery app is built on first access to ``workers.app``, from the environment's settings.
"""

from __future__ import annotations

import os
import tempfile
from typing import Any

from workers.sdk import AgentFailure, Context, Retryable, SessionConflict, agent

__all__ = ["AgentFailure", "Context", "Retryable", "SessionConflict", "agent", "app"]

_app: Any = None


def _prepare_metrics_dir() -> None:
    """Prefork children share metrics through files (prometheus-client's multiprocess mode);
    the folder must be known before prometheus_client is first imported."""
    if "PROMETHEUS_MULTIPROC_DIR" not in os.environ:
        os.environ["PROMETHEUS_MULTIPROC_DIR"] = tempfile.mkdtemp(prefix="reach-metrics-")
    # The celery command may have imported prometheus_client already (Flower's CLI plugin
    # does), fixing its value class before the folder was set: choose it again. Metrics are
    # created after this, when broker.observability.metrics is imported.
    from prometheus_client import values

    values.ValueClass = values.get_value_class()  # type: ignore[no-untyped-call]


def __getattr__(name: str) -> Any:
    # Celery's `-A workers` looks up `workers.app`; building it here, not at import, keeps
    # settings out of import time for code that only needs the SDK.
    global _app
    if name in ("app", "celery"):
        if _app is None:
            _prepare_metrics_dir()
            from broker.settings import Settings
            from workers.application import create_celery_app

            _app = create_celery_app(Settings())
        return _app
    raise AttributeError(f"module 'workers' has no attribute {name!r}")
