"""Baseline A and B: the bare Celery app a user would otherwise run.

One task, ``bench.noop``, that returns its argument (as the ``echo`` agent does), JSON only,
everything else Celery's defaults. The worker subprocess finds its broker and result backend in
``BENCH_BROKER_URL`` and ``BENCH_RESULT_BACKEND``:
``celery -A bench.bareapp worker -Q bench.noop``.
"""

from __future__ import annotations

import os
from typing import Any

from celery import Celery

TASK = "bench.noop"
QUEUE = "bench.noop"


def create_app(broker_url: str, result_backend: str) -> Celery:
    app = Celery("bench-bare", set_as_current=False)
    app.conf.update(
        broker_url=broker_url,
        result_backend=result_backend,
        broker_connection_retry_on_startup=True,
        task_serializer="json",
        result_serializer="json",
        accept_content=["json"],
        task_default_queue=QUEUE,
    )
    app.task(name=TASK)(noop)
    return app


def noop(payload: Any) -> Any:
    return payload


def __getattr__(name: str) -> Any:
    # `celery -A bench.bareapp` looks up `app`; built on access so importing needs no env.
    if name in ("app", "celery"):
        app = create_app(os.environ["BENCH_BROKER_URL"], os.environ["BENCH_RESULT_BACKEND"])
        globals().update(app=app, celery=app)
        return app
    raise AttributeError(f"module 'bench.bareapp' has no attribute {name!r}")
