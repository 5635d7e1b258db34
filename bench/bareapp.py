"""Baseline A and B: the bare Celery app a user would otherwise run.

One task, ``bench.noop``, that returns its argument (as the ``echo`` agent does); for the
model-latency phase ``bench.model``, one HTTP call to a model; for the remote-agent phase
``bench.agent``, one HTTP call to an agent. JSON only, everything else
Celery's defaults. The worker subprocess finds its broker and result backend in
``BENCH_BROKER_URL`` and ``BENCH_RESULT_BACKEND``:
``celery -A bench.bareapp worker -Q bench.noop``.
"""

from __future__ import annotations

import json
import os
from typing import Any

import urllib3
from celery import Celery

TASK = "bench.noop"
QUEUE = "bench.noop"
MODEL_TASK = "bench.model"  # one call to the model of the model-latency phase
MODEL_QUEUE = "bench.model"
AGENT_TASK = "bench.agent"  # one call to the remote-agent phase's HTTP agent
AGENT_QUEUE = "bench.agent"
_http: urllib3.PoolManager | None = None


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
    app.task(name=MODEL_TASK)(model_call)
    app.task(name=AGENT_TASK)(agent_call)
    return app


def noop(payload: Any) -> Any:
    return payload


def model_call(url: str, prompt: str, model: str = "default") -> str:
    """One completion from the model at ``url``."""
    body = {"model": model, "messages": [{"role": "user", "content": prompt}], "stream": False}
    content: str = _post(url, body)["choices"][0]["message"]["content"]
    return content


def agent_call(url: str, body: dict[str, Any]) -> Any:
    """One call to an HTTP agent at ``url``: the task a user would write to reach a remote
    agent with bare Celery, as the bridge does."""
    return _post(url, body)


def _post(url: str, body: dict[str, Any]) -> Any:
    """POST JSON with urllib3: the fastest client measured for threads and greenlets
    (``docs/performance.md``). One pool for the process, as many connections kept as there
    are calls at once."""
    global _http
    if _http is None:
        _http = urllib3.PoolManager(maxsize=1000)
    response = _http.request(
        "POST", url, body=json.dumps(body), headers={"Content-Type": "application/json"}, timeout=60
    )
    if response.status != 200:
        raise RuntimeError(f"{url} answered {response.status}")
    return json.loads(response.data)


def __getattr__(name: str) -> Any:
    # `celery -A bench.bareapp` looks up `app`; built on access so importing needs no env.
    if name in ("app", "celery"):
        app = create_app(os.environ["BENCH_BROKER_URL"], os.environ["BENCH_RESULT_BACKEND"])
        globals().update(app=app, celery=app)
        return app
    raise AttributeError(f"module 'bench.bareapp' has no attribute {name!r}")
