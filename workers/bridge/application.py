"""The bridge's Celery app: the workers' app, serving the remote agents' registry."""

from __future__ import annotations

from celery import Celery

from broker.settings import Settings
from broker.webhooks.ssrf import Guard
from workers.application import create_celery_app
from workers.bridge.keeper import bridge_step
from workers.bridge.registry import RemoteRegistry

BRIDGE_QUEUE = "reach.bridge"  # consumed so the worker starts with a queue of its own


def create_bridge_app(settings: Settings) -> Celery:
    registry = RemoteRegistry(
        Guard(allow=settings.agent_networks),
        first_byte_timeout_s=settings.remote_first_byte_timeout_s,
        card_timeout_s=settings.remote_health_timeout_s,
    )
    app = create_celery_app(settings, registry)
    app.conf.task_default_queue = BRIDGE_QUEUE
    app.steps["consumer"].add(bridge_step(settings, registry))
    return app
