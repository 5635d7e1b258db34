"""One trace id end to end, structured logs without payloads, Prometheus metrics that move."""

from __future__ import annotations

import inspect
import json
import logging
import re
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import psutil
import pytest
import redis
import redis.asyncio.connection
import redis.connection
from pydantic import SecretStr
from sqlalchemy import Engine, event, select

from api import system_gauges
from api.app import create_app
from api.services import Services
from broker.db.models import tasks_table
from broker.observability.logs import JsonFormatter
from broker.settings import Settings
from broker.tasks.dispatch import Dispatcher, send_run
from tests.eventually import eventually
from tests.integration.rows import a_task_row
from tests.integration.stack import (
    ROOT,
    CeleryProcess,
    ServedApp,
    environment,
    free_port,
    start_worker,
    wait_for_task,
)

FINAL = {"succeeded", "failed", "cancelled", "expired"}
TRACE = "4bf92f3577b34da6a3ce929d0e0e4736"
OTHER = "0af7651916cd43dd8448eb211c80319c"


def json_lines(text: str) -> list[dict[str, object]]:
    return [json.loads(line) for line in text.splitlines() if line.startswith("{")]


def test_one_trace_id_from_request_to_worker_log_task_and_events(
    client: httpx.Client, worker: CeleryProcess, caplog: pytest.LogCaptureFixture
) -> None:
    secret = "SECRET-PAYLOAD-7f3d"
    with caplog.at_level(logging.INFO, logger="reach.api"):
        response = client.post(
            "/tasks",
            json={"capability": "echo", "payload": {"note": secret}},
            headers={"traceparent": f"00-{TRACE}-00f067aa0ba902b7-01"},
        )
    assert response.headers["x-trace-id"] == TRACE
    task_id = response.json()["task_id"]
    done = wait_for_task(client, task_id, FINAL)
    assert done["trace_id"] == TRACE

    # The API's log line for this request carries the trace id, and the payload's digest only
    accepted = [r for r in caplog.records if r.getMessage() == "task accepted"]
    api_line = json.loads(JsonFormatter().format(accepted[-1]))
    assert api_line["trace_id"] == TRACE
    assert api_line["task_id"] == task_id
    assert api_line["payload_size"] > 0
    assert secret not in caplog.text

    # Every event of the task carries it
    events = client.get(f"/tasks/{task_id}/events").text
    ids = set(re.findall(r'"trace_id":"([0-9a-f]{32})"', events))
    assert ids == {TRACE}

    # The worker's JSON log lines for this task carry it, with a stable event name
    def worker_lines() -> list[dict[str, object]]:
        return [line for line in json_lines(worker.output()) if line.get("task_id") == task_id]

    eventually(
        worker_lines,
        "the worker to log the task claimed and finished",
        until=lambda lines: {"task claimed", "task finished"} <= {str(x["event"]) for x in lines},
    )
    for line in worker_lines():
        assert line["trace_id"] == TRACE
        assert line["capability"] == "echo"
        assert str(line["instance"]).startswith("agents@")
    assert secret not in worker.output()


def metric(text: str, name: str, **labels: str) -> float:
    """The value of one sample in Prometheus text format (0 when absent)."""
    wanted = ",".join(f'{k}="{v}"' for k, v in labels.items())
    pattern = rf"^{re.escape(name)}(?:\{{([^}}]*)\}})? (\S+)$"
    for match in re.finditer(pattern, text, re.M):
        found = match.group(1) or ""
        if all(part in found.split(",") for part in wanted.split(",") if part):
            return float(match.group(2))
    return 0.0


METRICS_TOKEN = "scrape-" + "7c1e" * 8


@pytest.fixture(scope="module")
def metrics_api(settings: Settings, worker: CeleryProcess) -> Iterator[ServedApp]:
    """An API whose /metrics needs a token, its system gauges refreshed every 0.2 s."""
    tuned = settings.model_copy(
        update={"metrics_token": SecretStr(METRICS_TOKEN), "metrics_refresh_s": 0.2}
    )
    with ServedApp(create_app(tuned)) as served:
        yield served


def scrape(api: ServedApp) -> str:
    response = httpx.get(f"{api.url}/metrics", headers={"Authorization": f"Bearer {METRICS_TOKEN}"})
    assert response.status_code == 200, response.text
    assert response.headers["content-type"].startswith("text/plain")
    return response.text


def test_api_metrics_expose_the_families_and_move(
    client: httpx.Client, metrics_api: ServedApp
) -> None:
    before = scrape(metrics_api)
    task = client.post("/tasks", json={"capability": "echo", "payload": {}}).json()
    wait_for_task(client, task["task_id"], FINAL)
    client.post("/tasks", json={"capability": "nobody.here", "payload": {}})
    # The system gauges are computed again on their schedule (every 0.2 s here)
    refreshed = "reach_system_gauges_refreshed_timestamp_seconds"
    after = eventually(
        lambda: scrape(metrics_api),
        "the system gauges refreshed",
        until=lambda text: metric(text, refreshed) > metric(before, refreshed),
    )
    for family in (
        "reach_http_requests_total",
        "reach_http_request_duration_seconds_bucket",
        "reach_submit_duration_seconds_bucket",
        "reach_routing_failures_total",
        "reach_queue_depth",
        "reach_queue_oldest_age_seconds",
        "reach_registry_ready_instances",
        "reach_registry_registered_instances",
        "reach_rejections_total",
        "reach_idempotency_total",
    ):
        assert family in after, family
    posted = metric(after, "reach_http_requests_total", method="POST", route="/tasks", status="202")
    assert posted > metric(
        before, "reach_http_requests_total", method="POST", route="/tasks", status="202"
    )
    assert metric(after, "reach_routing_failures_total", capability="_unknown") >= 1
    assert metric(after, "reach_registry_ready_instances") >= 1


def test_a_method_the_api_does_not_serve_is_counted_as_other(metrics_api: ServedApp) -> None:
    # Each method would be a series of its own, for as long as the process lives. httptools
    # passes on WebDAV's and others' (h11, uvicorn's other parser, any token): none is ours.
    other = {"method": "OTHER", "route": "/healthz", "status": "405"}
    before = metric(scrape(metrics_api), "reach_http_requests_total", **other)
    with httpx.Client(base_url=metrics_api.url) as http:
        for method in ("PROPFIND", "MKCOL", "PURGE"):
            assert http.request(method, "/healthz").status_code == 405
    scraped = scrape(metrics_api)
    assert not re.search("PROPFIND|MKCOL|PURGE", scraped)
    assert metric(scraped, "reach_http_requests_total", **other) == before + 3


def test_metrics_are_refused_without_the_metrics_token(
    metrics_api: ServedApp, api: ServedApp, tenant: tuple[str, str], settings: Settings
) -> None:
    url = f"{metrics_api.url}/metrics"
    bare = httpx.get(url)
    wrong = httpx.get(url, headers={"Authorization": f"Bearer {METRICS_TOKEN}x"})
    api_key = httpx.get(url, headers={"Authorization": f"Bearer {tenant[1]}"})
    for refused in (bare, wrong, api_key):
        assert refused.status_code == 401
        assert refused.headers["content-type"] == "application/problem+json"
        assert refused.json()["code"] == "unauthenticated"
        assert "reach_http_requests_total" not in refused.text
    # No token configured: closed (404), unless declared public as the dev stack does
    closed = httpx.get(f"{api.url}/metrics", headers={"Authorization": f"Bearer {tenant[1]}"})
    assert (closed.status_code, closed.json()["code"]) == (404, "route_not_found")
    with ServedApp(create_app(settings.model_copy(update={"metrics_public": True}))) as public:
        assert httpx.get(f"{public.url}/metrics").status_code == 200


def test_50_scrapes_send_no_query_to_postgres(settings: Settings, worker: CeleryProcess) -> None:
    # Given an API that computes its system gauges once (then hourly)
    app = create_app(
        settings.model_copy(
            update={"metrics_token": SecretStr(METRICS_TOKEN), "metrics_refresh_s": 3600}
        )
    )
    statements: list[str] = []
    event.listen(
        app.state.services.engine.sync_engine,
        "before_cursor_execute",
        lambda conn, cursor, statement, *rest: statements.append(statement),
    )
    with ServedApp(app) as served:
        eventually(lambda: app.state.services.gauges_refreshed_at, "the gauges computed once")
        refresh = len(statements)
        # When Prometheus scrapes 50 times
        for _ in range(50):
            text = scrape(served)
        # Then not one query reached Postgres, and the figures are those of the refresh
        assert statements[refresh:] == []
    assert refresh >= 3
    assert metric(text, "reach_registry_ready_instances") >= 1


def test_refreshes_read_queue_depths_without_opening_redis_connections(
    settings: Settings, worker: CeleryProcess, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Given an API that computes its system gauges every 0.05 s, the refreshes counted, and
    # every Redis connection this process opens counted (the API serves from this process;
    # a count on the server would hold every other process's connections too)
    refreshes: list[float] = []
    refresh = system_gauges.refresh

    async def counted(state: Services) -> None:
        await refresh(state)
        refreshes.append(time.monotonic())

    monkeypatch.setattr(system_gauges, "refresh", counted)
    opened: list[str] = []
    for kind in (redis.connection.Connection, redis.asyncio.connection.Connection):
        monkeypatch.setattr(kind, "_connect", _counting(kind._connect, opened))
    app = create_app(
        settings.model_copy(
            update={"metrics_token": SecretStr(METRICS_TOKEN), "metrics_refresh_s": 0.05}
        )
    )
    with ServedApp(app) as served:
        eventually(lambda: refreshes, "the gauges computed once")
        opened_before = len(opened)
        refreshed_before = len(refreshes)
        # When it refreshes them 40 times more
        eventually(lambda: len(refreshes) >= refreshed_before + 40, "40 refreshes", timeout_s=60)
        new = opened[opened_before:]
        refreshed = len(refreshes) - refreshed_before
        text = scrape(served)
    # Then the depths came over the connections it holds. Before, each refresh opened at
    # least one (a kombu connection, its CLIENT SETINFO, redis-py's version read from the
    # package metadata), and one more for each empty queue: 77 a refresh here.
    assert len(new) < refreshed / 4, (len(new), refreshed)
    assert "reach_queue_depth{" in text


def _counting(connect: Any, opened: list[str]) -> Any:
    """``connect`` (a redis-py connection's ``_connect``, sync or async), noting each call."""
    if inspect.iscoroutinefunction(connect):

        async def counted_async(self: Any) -> Any:
            opened.append(type(self).__name__)
            return await connect(self)

        return counted_async

    def counted(self: Any) -> Any:
        opened.append(type(self).__name__)
        return connect(self)

    return counted


def finished_late(scraped: str) -> float:
    return metric(scraped, "reach_tasks_finished_total", capability="test.late", status="succeeded")


def test_a_worker_serves_its_metrics_merged_over_its_pool_on_loopback(
    client: httpx.Client, settings: Settings, log_dir: Path
) -> None:
    port = free_port()
    late = start_worker(
        settings.model_copy(update={"worker_metrics_port": port}), "test.late", "metrics", log_dir
    )
    try:
        ids = [
            client.post("/tasks", json={"capability": "test.late", "payload": {}}).json()["task_id"]
            for _ in range(3)
        ]
        for task_id in ids:
            wait_for_task(client, task_id, FINAL)
        # The worker counts a task finished once its final write is in: the API can answer
        # the last one's read before its process has counted it
        text = eventually(
            lambda: httpx.get(f"http://127.0.0.1:{port}/metrics").text,
            "the worker to count the three tasks finished",
            until=lambda scraped: finished_late(scraped) >= 3,
        )
        listening = {
            c.laddr.ip
            for c in psutil.Process(late.pid).net_connections("tcp")
            if c.status == psutil.CONN_LISTEN and c.laddr.port == port
        }
    finally:
        late.stop()
    assert finished_late(text) == 3
    assert metric(text, "reach_task_run_seconds_count", capability="test.late") == 3
    assert listening == {"127.0.0.1"}  # unauthenticated: not on every interface


def test_celery_inspect_lists_the_capability_queues(
    settings: Settings, worker: CeleryProcess
) -> None:
    result = subprocess.run(
        [
            str(Path(sys.executable).parent / "celery"),
            "-A",
            "workers",
            "inspect",
            "active_queues",
            "--json",
            "--timeout",
            "5",
        ],
        env=environment(settings),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 0, result.stderr
    answers = json.loads(result.stdout.strip().splitlines()[-1])
    by_worker = {name.split("@")[0]: {q["name"] for q in qs} for name, qs in answers.items()}
    assert {"echo", "invoice.extract", "text.summarize"} <= by_worker["agents"]
    assert by_worker["maintenance"] == {"reach.maintenance"}
    assert by_worker["webhooks"] == {"reach.webhooks"}


def test_one_trace_id_reaches_the_webhook_too(client: httpx.Client, worker: CeleryProcess) -> None:
    from standardwebhooks import Webhook

    from tests.integration.receiver import Receiver
    from tests.integration.webhook_client import register

    trace = "0af7651916cd43dd8448eb211c80319c"
    with Receiver() as receiver:
        _, secret = register(client, receiver.url, events=["task.succeeded"])
        response = client.post(
            "/tasks",
            json={"capability": "echo", "payload": {"t": 1}},
            headers={"X-Trace-Id": trace},
        )
        [call] = receiver.wait_for(1)
    event = Webhook(secret).verify(call.body, call.headers)
    assert event["data"]["task_id"] == response.json()["task_id"]
    assert event["data"]["trace_id"] == trace
    assert call.headers["x-trace-id"] == trace
    assert any(
        line.get("trace_id") == trace and line.get("event") == "task finished"
        for line in json_lines(worker.output())
    )


def test_cancelling_a_task_announces_task_cancelled(client: httpx.Client) -> None:
    from standardwebhooks import Webhook

    from tests.integration.receiver import Receiver
    from tests.integration.webhook_client import register

    with Receiver() as receiver:
        _, secret = register(client, receiver.url, events=["task.cancelled"])
        task = client.post(
            "/tasks",
            json={"capability": "test.nobody-serves", "payload": {}, "queue_if_unavailable": True},
        ).json()
        assert client.post(f"/tasks/{task['task_id']}/cancel").status_code == 200
        [call] = receiver.wait_for(1)
    event = Webhook(secret).verify(call.body, call.headers)
    assert event["type"] == "task.cancelled"
    assert event["data"]["task_id"] == task["task_id"]


# Run in a process of its own: OpenTelemetry's tracer provider is set once per process, so
# this one owns it whatever else ran before (no skip when another test set one first).
OTEL_CHILD = """
import json, sys, time
import httpx
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from api.app import create_app
from broker.observability import otel
from broker.settings import Settings
from tests.integration.stack import ServedApp

token, cases = sys.argv[1], json.loads(sys.argv[2])
exporter = InMemorySpanExporter()
otel.setup_tracing("reach-test", exporter=exporter)
app = create_app(Settings(otel=True))
found = {}
with ServedApp(app) as served, httpx.Client(base_url=served.url) as http:
    for name, headers in cases.items():
        exporter.clear()
        answer = http.get("/tasks", headers=[("Authorization", f"Bearer {token}"), *headers])
        deadline = time.monotonic() + 10  # the server's span ends just after its answer
        while time.monotonic() < deadline:
            spans = exporter.get_finished_spans()
            if any(s.name == "GET /tasks" for s in spans):
                break
            time.sleep(0.01)
        found[name] = {
            "status": answer.status_code,
            "ours": answer.headers["x-trace-id"],
            "spans": sorted({f"{s.context.trace_id:032x}" for s in spans}),
        }
print(json.dumps(found))
"""
SPAN = "00f067aa0ba902b7"
# name -> the request's trace headers, and the trace it continues (None: a new one)
OTEL_CASES: dict[str, tuple[list[tuple[str, str]], str | None]] = {
    "none": ([], None),
    "traceparent": ([("traceparent", f"00-{TRACE}-{SPAN}-01")], TRACE),
    "x-trace-id": ([("X-Trace-Id", OTHER)], OTHER),
    "a later version": ([("traceparent", f"01-{TRACE}-{SPAN}-01-more")], TRACE),
    # invalid (W3C, and OpenTelemetry): ours was taken from some, a new one from others
    "uppercase": ([("traceparent", f"00-{TRACE.upper()}-{SPAN}-01")], None),
    "version ff": ([("traceparent", f"ff-{TRACE}-{SPAN}-01")], None),
    "zero parent": ([("traceparent", f"00-{TRACE}-{'0' * 16}-01")], None),
    "junk": ([("traceparent", "junk")], None),
    "junk and x-trace-id": ([("traceparent", "junk"), ("X-Trace-Id", OTHER)], OTHER),
    # OpenTelemetry continues the first of several (ours took the last)
    "two": (
        [("traceparent", f"00-{TRACE}-{SPAN}-01"), ("traceparent", f"00-{OTHER}-{SPAN}-01")],
        TRACE,
    ),
}


def test_with_opentelemetry_on_our_trace_id_is_the_spans_trace(
    settings: Settings, tenant: tuple[str, str]
) -> None:
    """Whatever trace headers a request brings, its X-Trace-Id is the trace its spans are
    in: ours and OpenTelemetry's read them differently (uppercase, version ff, a later
    version's fields, several headers), and the two parted."""
    cases = {name: headers for name, (headers, _) in OTEL_CASES.items()}
    child = subprocess.run(
        [sys.executable, "-c", OTEL_CHILD, tenant[1], json.dumps(cases)],
        env=environment(settings),
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert child.returncode == 0, child.stderr
    found = json.loads(child.stdout.strip().splitlines()[-1])
    for name, (_, continued) in OTEL_CASES.items():
        got = found[name]
        assert got["status"] == 200, name
        assert got["spans"] == [got["ours"]], name
        if continued is not None:
            assert got["ours"] == continued, name
        else:
            assert got["ours"] not in (TRACE, OTHER), name


def test_a_message_whose_task_is_not_to_run_is_logged_with_its_trace_and_tenant(
    settings: Settings, engine: Engine, worker: CeleryProcess
) -> None:
    """Lines were bound to the task's trace once its claim succeeded: a redelivered message,
    a cancelled task's, a session's turn not yet due were logged with neither."""
    task_id = a_task_row(engine, tenant="tenant-traced", status="cancelled")
    with engine.connect() as conn:
        trace_id = conn.execute(
            select(tasks_table.c.trace_id).where(tasks_table.c.id == task_id)
        ).scalar_one()
    dispatcher = Dispatcher(settings)
    try:
        send_run(dispatcher.app, task_id, "echo", trace_id=trace_id, tenant="tenant-traced")
    finally:
        dispatcher.close()

    def lines() -> list[dict[str, object]]:
        return [line for line in json_lines(worker.output()) if line.get("task_id") == str(task_id)]

    found = eventually(
        lines,
        "the worker to skip the cancelled task's message",
        until=lambda found: any("skipped" in str(line["event"]) for line in found),
    )
    assert {(line["trace_id"], line["tenant"]) for line in found} == {(trace_id, "tenant-traced")}


def test_reach_api_writes_uvicorns_lines_as_its_own(settings: Settings, tmp_path: Path) -> None:
    """uvicorn's start, stop and access lines were plain text with its own configuration,
    among the API's JSON lines, and a request's path in them unescaped. Two processes: the
    supervisor's lines and each worker process's."""
    from tests.integration.test_many_processes import ApiProcess

    api = ApiProcess(settings, tmp_path / "api.log", workers=2).start()
    try:
        assert httpx.get(f"{api.url}/healthz?probe=%0Aforged", timeout=10).status_code == 200
        eventually(api.output, "the access line", 30, 0.2, until=lambda out: "/healthz" in out)
    finally:
        api.stop()
    lines = [line for line in api.output().splitlines() if line.strip()]
    records = [json.loads(line) for line in lines]  # each line one JSON record
    loggers = {record["logger"] for record in records}
    assert {"uvicorn.error", "uvicorn.access"} <= loggers, loggers
    (access,) = [
        r for r in records if r["logger"] == "uvicorn.access" and "/healthz" in r["message"]
    ]
    assert "GET /healthz?probe=%0Aforged" in access["message"]
    started = [r for r in records if r["message"].startswith("Started server process")]
    assert len(started) == 2, started
