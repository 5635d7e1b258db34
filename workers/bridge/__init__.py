"""The bridge: the worker that serves remote agents.

``celery -A workers.bridge worker -P threads -c 500``.

It consumes the queues of every registered remote agent (``PUT /agents/{agent_id}``), picking
up registrations and deregistrations every few seconds without a restart, and calls the
agents on the process's event loop, many at once (``workers.bridge.http_agent``). It holds
each agent's lease while the agent's health check answers (``workers.bridge.keeper``).
"""

from __future__ import annotations

from typing import Any

_app: Any = None


def __getattr__(name: str) -> Any:
    # ``celery -A workers.bridge`` looks up ``workers.bridge.app``.
    global _app
    if name in ("app", "celery"):
        if _app is None:
            from workers import metrics_dirs

            metrics_dirs.prepare()  # before prometheus_client's metrics are made
            from broker.settings import Settings
            from workers.bridge.application import create_bridge_app

            _app = create_bridge_app(Settings())
        return _app
    raise AttributeError(f"module 'workers.bridge' has no attribute {name!r}")
