"""``GET /capabilities/{capability}/series``: a capability's last hour, minute by minute, from
tasks a real worker ran; scoped like ``GET /capabilities``; its query on the index made for it."""

from __future__ import annotations

import asyncio
import uuid
from collections import Counter
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from datetime import datetime, timedelta
from itertools import pairwise
from typing import Any

import httpx
import pytest
from sqlalchemy import Engine, text

from broker.cache import TimedCache
from broker.db.engines import async_engine
from broker.registry import figures
from broker.settings import Settings
from broker.tasks.resource import FAILED, SUCCEEDED
from broker.tenancy import key_store
from tests.integration.activity import at_once
from tests.integration.conftest import KeyMaker, client_for
from tests.integration.stack import CeleryProcess, ServedApp, wait_for_task
from tests.integration.webhook_client import submit

FINAL = {"succeeded", "failed", "cancelled", "expired"}
INDEX = "ix_tasks_tenant_served_finished_at"


@pytest.fixture
def operator(api: ServedApp, engine: Engine, tenant: tuple[str, str]) -> Iterator[httpx.Client]:
    """An operator key of ``client``'s tenant: it sees every card, hidden ones too."""
    _, token = key_store.create_key(engine, tenant[0], ["*"], is_admin=True)
    with client_for(api, token) as http:
        yield http


def run(client: httpx.Client, capability: str = "echo", **payload: Any) -> dict[str, Any]:
    task = submit(client, capability, payload=payload)
    return wait_for_task(client, task["task_id"], FINAL)


def series(client: httpx.Client, capability: str = "echo", **params: Any) -> httpx.Response:
    return client.get(f"/capabilities/{capability}/series", params=params)


def at(value: str) -> datetime:
    return datetime.fromisoformat(value)


def minute_of(value: str) -> str:
    """The start of the minute ``value`` falls in, written as the API writes a bucket's start."""
    return at(value).replace(second=0, microsecond=0).isoformat().replace("+00:00", "Z")


def percentile(values: list[float], fraction: float) -> float:
    """Postgres's ``percentile_cont``: linear between the two nearest ranks."""
    ordered = sorted(values)
    position = fraction * (len(ordered) - 1)
    low = int(position)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (position - low)


def seconds(task: dict[str, Any], since: str) -> float:
    return (at(task["finished_at"]) - at(task[since])).total_seconds()


def problem(response: httpx.Response) -> tuple[int, str | None, str | None]:
    is_problem = response.headers["content-type"] == "application/problem+json"
    body = response.json() if is_problem else {}
    return response.status_code, body.get("code"), body.get("detail")


def test_the_series_counts_each_task_in_the_minute_it_finished_with_its_outcome_and_times(
    client: httpx.Client,
) -> None:
    # Given three echo tasks that succeeded and one that failed, run by the worker
    tasks = [run(client, i=i) for i in range(3)] + [run(client, fail="out_of_paper")]
    assert Counter(t["status"] for t in tasks) == {SUCCEEDED: 3, FAILED: 1}

    # When the tenant asks for the last hour, minute by minute (the defaults)
    found = series(client).json()

    # Then the axis is whole: 61 minutes, one after the other, the last holding now
    buckets = found["buckets"]
    assert (found["capability"], found["window_s"], found["step_s"]) == ("echo", 3600, 60)
    assert len(buckets) == 61
    starts = [at(b["start_at"]) for b in buckets]
    assert all(b - a == timedelta(minutes=1) for a, b in pairwise(starts))
    assert all(s.second == 0 and s.microsecond == 0 for s in starts)
    # ... each task counted in the minute it finished, succeeded and failed apart
    expected = Counter(minute_of(t["finished_at"]) for t in tasks)
    assert {b["start_at"]: b["tasks"] for b in buckets if b["tasks"]} == expected
    failed_in = minute_of(tasks[-1]["finished_at"])
    assert sum(b["failed"] for b in buckets) == 1
    assert next(b for b in buckets if b["start_at"] == failed_in)["failed"] == 1
    assert all(b["succeeded"] + b["failed"] == b["tasks"] for b in buckets)
    # ... empty minutes as zeros with no times, and times wherever tasks finished
    empty = [b for b in buckets if not b["tasks"]]
    assert len(empty) == 61 - len(expected)
    assert all(b["succeeded"] == b["failed"] == 0 for b in empty)
    assert all(b["p50_run_s"] is b["p95_total_s"] is None for b in empty)
    assert all(b["p50_run_s"] is not None for b in buckets if b["tasks"])
    # ... and the total over the hour: the counts, and the percentiles of the tasks' own times
    total = found["total"]
    assert (total["tasks"], total["succeeded"], total["failed"]) == (4, 3, 1)
    runs = [seconds(t, "started_at") for t in tasks]
    totals = [seconds(t, "created_at") for t in tasks]
    assert total["p50_run_s"] == pytest.approx(percentile(runs, 0.5), abs=1e-4)
    assert total["p95_run_s"] == pytest.approx(percentile(runs, 0.95), abs=1e-4)
    assert total["p50_total_s"] == pytest.approx(percentile(totals, 0.5), abs=1e-4)
    assert total["p95_total_s"] == pytest.approx(percentile(totals, 0.95), abs=1e-4)
    assert 0 <= total["p50_run_s"] <= total["p95_run_s"] <= total["p95_total_s"]


def test_hourly_buckets_count_the_same_tasks_and_agree_with_the_capabilities_figures(
    client: httpx.Client,
) -> None:
    # Given two echo tasks run a moment ago, one asked of a longer name that echo served
    asked = [run(client, i=1), run(client, "echo.shouty", i=2)]
    assert [t["capability"] for t in asked] == ["echo", "echo.shouty"]
    assert all(t["status"] == SUCCEEDED for t in asked)

    # When the tenant asks for a day in hours
    found = series(client, window_s=86400, step_s=3600).json()

    # Then 25 whole hours hold both tasks: counted, like the table's figures, for echo
    assert len(found["buckets"]) == 25
    assert all(at(b["start_at"]).minute == 0 for b in found["buckets"])
    assert sum(b["tasks"] for b in found["buckets"]) == found["total"]["tasks"] == 2
    measured = next(
        c for c in client.get("/capabilities").json()["capabilities"] if c["capability"] == "echo"
    )["measured"]
    assert measured["tasks"] == 2


def test_another_tenants_tasks_are_not_counted(
    client: httpx.Client, api: ServedApp, make_key: KeyMaker
) -> None:
    # Given another tenant that ran three echo tasks, and this one that ran one
    _, stranger = make_key()
    with client_for(api, stranger) as other:
        for i in range(3):
            run(other, i=i)
        assert series(other).json()["total"]["tasks"] == 3
    run(client, i=0)

    # When this tenant reads echo's series, then it counts its own task only
    assert series(client).json()["total"]["tasks"] == 1


def test_a_capability_the_key_is_not_shown_is_404_like_an_unknown_one(
    api: ServedApp, make_key: KeyMaker, client: httpx.Client, operator: httpx.Client
) -> None:
    _, echo_only = make_key(["echo"])
    with client_for(api, echo_only) as limited:
        unknown = problem(series(limited, "no.such"))
        # A capability outside the key's patterns, one only another tenant's card serves,
        # and a name outside the grammar all read as unknown
        outside = problem(series(limited, "invoice.extract"))
        assert series(limited, "echo").status_code == 200
    hidden = problem(series(client, "test.hidden"))
    malformed = problem(series(client, "Not-A-Name"))

    assert unknown == (404, "capability_not_found", "no such capability")
    assert outside == hidden == malformed == unknown
    # An operator sees every card, so the hidden capability's (empty) series too
    shown = series(operator, "test.hidden")
    assert shown.status_code == 200
    assert shown.json()["total"]["tasks"] == 0


@pytest.mark.parametrize(
    "params",
    [
        {"window_s": 59},
        {"window_s": 86401},
        {"window_s": "an hour"},
        {"step_s": 0},
        {"step_s": 3601},
        {"step_s": 1.5},
        {"step_s": ""},
    ],
)
def test_a_window_or_step_out_of_bounds_is_422_invalid_parameter(
    client: httpx.Client, params: dict[str, Any]
) -> None:
    status, code, _ = problem(series(client, **params))
    assert (status, code) == (422, "invalid_parameter")


# A week of many tenants' tasks, 40 capabilities each served by a capability or a card queue.
MANY_TASKS = text(
    "INSERT INTO tasks (id, tenant, capability, queue, status, payload, payload_digest,"
    " payload_size, trace_id, result_ttl_s, created_at, started_at, finished_at, expires_at)"
    " SELECT gen_random_uuid(), 'plan-' || (i % 50), c,"
    "  CASE WHEN i % 3 = 0 THEN c || '@agent@1.0.0' ELSE c END, 'succeeded', '{}', 'd', 2,"
    "  'trace', 60, f - interval '2 seconds', f - interval '1 second', f, f + interval '1 day'"
    " FROM (SELECT i, 'plan' || (i % 40) || '.run' AS c,"
    "             now() - (i % 10080) * interval '1 minute' AS f"
    "       FROM generate_series(1, :n) AS i) AS g"
)


def test_the_series_query_reads_the_index_made_for_it(engine: Engine) -> None:
    # Given a table of many tenants' tasks over a week, its statistics fresh (all of it
    # rolled back at the end: nothing is left for other tests)
    explain = text("EXPLAIN " + figures.SERIES_QUERY.text)
    params = {"tenant": "plan-7", "capability": "plan7.run", "window_s": 3600, "step_s": 60}
    params |= figures.seen_by(["plan7.*"])  # a key's patterns: the index still bounds it
    with engine.connect() as conn:
        conn.execute(MANY_TASKS, {"n": 50_000})
        conn.execute(text("ANALYZE tasks"))
        # When the series query of one tenant's capability is planned
        plan = "\n".join(
            conn.execute(explain, {**params, "succeeded": SUCCEEDED, "failed": FAILED}).scalars()
        )
        conn.rollback()
    # Then it is one range of the index: tenant, serving capability and finished_at bounded
    assert f"Index Scan using {INDEX} on tasks" in plan, plan
    cond = next(line for line in plan.splitlines() if "Index Cond" in line)
    assert "tenant" in cond and "split_part" in cond and "finished_at >=" in cond, plan


# One tenant's tasks of echo, finished over the last day.
TENANTS_DAY = text(
    "INSERT INTO tasks (id, tenant, capability, queue, status, payload, payload_digest,"
    " payload_size, trace_id, result_ttl_s, created_at, started_at, finished_at, expires_at)"
    " SELECT gen_random_uuid(), :tenant, 'echo', 'echo', 'succeeded', '{}', 'd', 2, 'trace', 60,"
    "  f - interval '2 seconds', f - interval '1 second', f, f + interval '1 day'"
    " FROM (SELECT now() - (i % 1440) * interval '1 minute' AS f"
    "       FROM generate_series(1, :n) AS i) AS g"
)
# The statements of the figures and the series running in Postgres now (by their start:
# pg_stat_activity keeps a statement's first 1 KiB, which ends before the series' SELECT).
AGGREGATES_RUNNING = (
    "SELECT count(*) FROM pg_stat_activity WHERE state = 'active'"
    " AND datname = current_database()"
    " AND (query LIKE '%percentile_cont%' OR query LIKE 'WITH axis AS%')"
    " AND backend_type = 'client backend' AND pid <> pg_backend_pid()"  # no parallel workers
)


def test_one_tenants_aggregates_run_one_at_a_time_and_the_same_one_is_answered_again(
    api: ServedApp,
    tenant: tuple[str, str],
    engine: Engine,
    settings: Settings,
    worker: CeleryProcess,  # echo is served, so shown
) -> None:
    """A series over a day of a busy tenant's tasks is real work for Postgres (0.2 s for
    40,000 tasks). Asked for many at once, each took a backend: one tenant could take every
    core. Now a tenant's figures and series run one at a time per API process, and the same
    question within ``REACH_FIGURES_CACHE_S`` gets the answer already computed."""
    # Given 60,000 tasks of the tenant finished over the last day
    with engine.begin() as conn:
        conn.execute(TENANTS_DAY, {"tenant": tenant[0], "n": 60_000})
        conn.execute(text("ANALYZE tasks"))

    def ask(window_s: int) -> int:
        with client_for(api, tenant[1]) as http:
            return series(http, window_s=window_s).status_code

    try:
        # When eight series of different windows are asked for at once
        with at_once(settings, AGGREGATES_RUNNING) as seen, ThreadPoolExecutor(8) as pool:
            statuses = list(pool.map(ask, [3600 * k for k in range(17, 25)]))
        # Then each is answered, and Postgres ran one of them at a time
        assert statuses == [200] * 8
        assert max(seen) == 1, Counter(seen)
        # And the same question again, after one more task finished, gets the same answer
        with client_for(api, tenant[1]) as http:
            first = series(http, window_s=3600).json()
            with engine.begin() as conn:
                conn.execute(TENANTS_DAY, {"tenant": tenant[0], "n": 1})
            again = series(http, window_s=3600).json()
            other = series(http, window_s=3600, step_s=120).json()  # another question
        assert again == first
        with engine.connect() as conn:
            since = at(other["buckets"][0]["start_at"])
            held = conn.execute(
                text("SELECT count(*) FROM tasks WHERE tenant = :t AND finished_at >= :since"),
                {"t": tenant[0], "since": since},
            ).scalar()
        assert other["total"]["tasks"] == held  # computed now, the new task in it
    finally:
        with engine.begin() as conn:
            conn.execute(text("DELETE FROM tasks WHERE tenant = :t"), {"t": tenant[0]})


# Tasks of three agents finished in the last five minutes, a third of agent a1's failed
# (crashed: its own fault).
RECENT_BY_AGENT = text(
    "INSERT INTO tasks (id, tenant, capability, queue, status, payload, payload_digest,"
    " payload_size, trace_id, result_ttl_s, created_at, started_at, finished_at, expires_at,"
    " agent_id, agent_version, error)"
    " SELECT gen_random_uuid(), :tenant, 'echo', 'echo',"
    "  CASE WHEN i % 3 = 1 AND i % 9 < 3 THEN 'failed' ELSE 'succeeded' END, '{}', 'd', 2,"
    "  'trace', 60, f, f, f, f + interval '1 day', 'rates-a' || (i % 3), '1',"
    '  CASE WHEN i % 3 = 1 AND i % 9 < 3 THEN \'{"code": "agent_error"}\'::jsonb END'
    " FROM (SELECT i, now() - (i % 240) * interval '1 second' AS f"
    "       FROM generate_series(1, :n) AS i) AS g"
)
SUCCESS_RATES_RUNNING = (
    "SELECT count(*) FROM pg_stat_activity WHERE state = 'active'"
    " AND datname = current_database() AND query LIKE '%GROUP BY agent_id, agent_version%'"
    " AND backend_type = 'client backend' AND pid <> pg_backend_pid()"  # no parallel workers
)


def test_the_success_rates_every_submit_reads_are_one_query_for_the_submits_arriving_together(
    engine: Engine, settings: Settings
) -> None:
    """Every submit reads the agents' success rates of the last five minutes (routing's
    scores), cached for ``REACH_CARD_CACHE_S``. It reads every tenant's tasks of the window;
    at each expiry the submits arriving meanwhile each sent it again, all at once."""
    # Given 90,000 tasks of three agents finished in the last five minutes
    tenant = "rates-" + uuid.uuid4().hex[:8]
    with engine.begin() as conn:
        conn.execute(RECENT_BY_AGENT, {"tenant": tenant, "n": 90_000})
        conn.execute(text("ANALYZE tasks"))

    async def twenty_submits_at_expiry() -> list[dict[tuple[str, str], float]]:
        aengine = async_engine(settings)
        try:
            cache = TimedCache(ttl_s=60)  # empty: as at expiry
            return await asyncio.gather(*(figures.success_rates(aengine, cache) for _ in range(20)))
        finally:
            await aengine.dispose()

    try:
        # When twenty submits ask for them at once
        with at_once(settings, SUCCESS_RATES_RUNNING) as seen:
            answers = asyncio.run(twenty_submits_at_expiry())
    finally:
        with engine.begin() as conn:
            conn.execute(text("DELETE FROM tasks WHERE tenant = :t"), {"t": tenant})
    # Then one query answered them all, the same answer
    assert max(seen) == 1, Counter(seen)
    assert all(answer == answers[0] for answer in answers)
    rates = {agent: rate for (agent, _), rate in answers[0].items() if agent.startswith("rates-")}
    assert rates == {"rates-a0": 1.0, "rates-a1": pytest.approx(2 / 3, abs=0.01), "rates-a2": 1.0}


# One finished task of an agent, as a worker writes it: its status, its error's code, and
# whether it ended at a deadline its caller gave.
FINISHED_BY = text(
    "INSERT INTO tasks (id, tenant, capability, queue, status, payload, payload_digest,"
    " payload_size, trace_id, result_ttl_s, created_at, started_at, finished_at, expires_at,"
    " agent_id, agent_version, error, deadline_at)"
    " VALUES (gen_random_uuid(), :tenant, 'echo', 'echo', :status, '{}', 'd', 2, 'trace', 60,"
    "  now(), now(), now(), now() + interval '1 day', :agent, '1',"
    "  CASE WHEN CAST(:code AS text) IS NULL THEN NULL"
    "       ELSE jsonb_build_object('code', CAST(:code AS text), 'message', 'm') END,"
    "  CASE WHEN :at_deadline THEN now() END)"
)


def test_an_agents_success_rate_counts_its_own_failures_not_what_its_callers_did(
    engine: Engine, settings: Settings
) -> None:
    """Every tenant's routing reads the rates: one tenant's cancels, deadlines and inputs
    the agent refused made a healthy agent's rate theirs (an audit, 2026-12-06)."""
    tenant, run = "rates-" + uuid.uuid4().hex[:8], uuid.uuid4().hex[:8]
    steered, failing = f"steered-{run}", f"failing-{run}"
    ended: dict[str, list[tuple[str, str | None, bool]]] = {
        # 4 succeeded; a caller cancelled 3, let 3 reach its deadline, sent 2 it refused
        steered: [(SUCCEEDED, None, False)] * 4
        + [("cancelled", "cancelled", False)] * 3
        + [("expired", "timeout", True)] * 3
        + [(FAILED, "bad_input", False)] * 2,
        # 3 succeeded; it crashed once, ran past its own limit once, answered a 503 once,
        # never answered once, broke its stream off once, answered no JSON once (the last
        # three counted for nothing before)
        failing: [(SUCCEEDED, None, False)] * 3
        + [(FAILED, "agent_error", False), ("expired", "timeout", False)]
        + [(FAILED, "agent_http_503", False), (FAILED, "agent_timeout", False)]
        + [(FAILED, "agent_stream_broken", False), (FAILED, "result_invalid", False)],
    }
    with engine.begin() as conn:
        for agent, outcomes in ended.items():
            for status, code, at_deadline in outcomes:
                conn.execute(
                    FINISHED_BY,
                    {
                        "tenant": tenant,
                        "status": status,
                        "agent": agent,
                        "code": code,
                        "at_deadline": at_deadline,
                    },
                )

    async def rates() -> dict[tuple[str, str], float]:
        aengine = async_engine(settings)
        try:
            return await figures.success_rates(aengine, TimedCache(ttl_s=60))
        finally:
            await aengine.dispose()

    try:
        found = asyncio.run(rates())
    finally:
        with engine.begin() as conn:
            conn.execute(text("DELETE FROM tasks WHERE tenant = :t"), {"t": tenant})
    assert found[(steered, "1")] == 1.0
    assert found[(failing, "1")] == pytest.approx(3 / 9)
