"""The Celery app of the workers: the composition root on the worker side."""

from __future__ import annotations

import importlib

from celery import Celery, signals

from broker import execution
from broker.dispatch import PURGE_TASK, RUN_TASK, celery_config
from broker.settings import Settings
from workers.lease import lease_step
from workers.runner import Runner
from workers.sdk.registry import AgentRegistry, agent


def load_agents(modules: list[str]) -> None:
    """Import the modules that hold agents; their decorators register them."""
    for module in modules:
        importlib.import_module(module)


def create_celery_app(settings: Settings, registry: AgentRegistry = agent) -> Celery:
    app = Celery("workers", set_as_current=True)
    app.conf.update(celery_config(settings))
    app.conf.beat_schedule = {
        "purge-expired-tasks": {"task": PURGE_TASK, "schedule": settings.janitor_interval_s},
    }
    load_agents(settings.agents)
    runner = Runner(settings, registry)
    app.steps["consumer"].add(lease_step(settings, registry))

    def drain_on_shutdown(**_: object) -> None:
        keeper = getattr(app, "reach_lease_keeper", None)
        if keeper is not None:
            keeper.begin_drain(stop_consuming=False)

    signals.worker_shutting_down.connect(drain_on_shutdown, weak=False)

    @app.task(name=RUN_TASK, bind=True)  # type: ignore[untyped-decorator]
    def run(self: object, task_id: str, queue: str) -> str:
        hostname = getattr(getattr(self, "request", None), "hostname", None) or "unknown"
        return runner.run(task_id, queue, instance=hostname)

    @app.task(name=PURGE_TASK)  # type: ignore[untyped-decorator]
    def purge_expired() -> int:
        return execution.purge_expired(runner.engine, batch=settings.janitor_batch)

    return app
