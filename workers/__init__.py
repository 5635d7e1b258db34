"""Agent-Reach workers: ``celery -A workers worker -Q <capability>``.

Agents import the SDK from here: ``from workers import agent, Context, AgentFailure``.
The Celery app is built on first access to ``workers.app``, from the environment's settings.
"""

from __future__ import annotations

from typing import Any

from workers.sdk import AgentFailure, Context, Retryable, SessionConflict, agent

__all__ = ["AgentFailure", "Context", "Retryable", "SessionConflict", "agent", "app"]

_app: Any = None


def __getattr__(name: str) -> Any:
    # Celery's `-A workers` looks up `workers.app`; building it here, not at import, keeps
    # settings out of import time for code that only needs the SDK.
    global _app
    if name in ("app", "celery"):
        if _app is None:
            from workers import metrics_dirs

            metrics_dirs.prepare()  # before prometheus_client's metrics are made
            from broker.settings import Settings
            from workers.application import create_celery_app

            _app = create_celery_app(Settings())
        return _app
    raise AttributeError(f"module 'workers' has no attribute {name!r}")
