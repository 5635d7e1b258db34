"""What the broker measured of agents and capabilities from the tasks they finished (never from
what an agent says of itself): figures over the last ``WINDOW_S`` seconds, and a capability's
series over a longer window, bucket by bucket.

A task counts for the capability that served it, the part of its queue before ``@`` (a task
asked of ``invoice.extract.zh`` and served by ``invoice.extract`` counts for the latter), and
only once it ran: a task cancelled or expired while queued has no run time."""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Hashable, Sequence
from dataclasses import dataclass, field
from typing import Any

from sqlalchemy import Row, text
from sqlalchemy.ext.asyncio import AsyncEngine

from broker.cache import TimedCache
from broker.tasks.resource import CANCELLED, EXPIRED, FAILED, SUCCEEDED
from broker.tenancy.heavy import OneAtATime
from broker.timestamps import iso

WINDOW_S = 300


@dataclass
class Aggregates:
    """The figures and series a tenant asks for, computed one at a time per tenant in this
    process, and each answer given again for ``ttl_s``.

    Each is an aggregate over the tenant's finished tasks, up to a day of them: 0.2 s of
    Postgres for a tenant with 40,000 tasks, a minute for one that ran 200 tasks/s all day.
    Asked for faster than they are computed (a dashboard in many tabs, or a hostile tenant
    at its request rate), they took every Postgres core from every tenant. Now a tenant's
    requests wait for its aggregate in progress (within its share of the waiting requests,
    ``REACH_MAX_REQUESTS_WAITING_PER_TENANT``), and the same question within ``ttl_s`` gets the
    answer already computed: one tenant keeps at most one Postgres backend busy per API
    process (``OneAtATime``). The last answer of each kind is kept per tenant, so asking many
    questions keeps no more of them."""

    ttl_s: float
    reads: OneAtATime = field(default_factory=OneAtATime)
    _answers: TimedCache = field(init=False)

    def __post_init__(self) -> None:
        self._answers = TimedCache(ttl_s=self.ttl_s)

    async def get(
        self,
        tenant: str,
        kind: str,
        question: Hashable,
        compute: Callable[[], Awaitable[Any]],
    ) -> Any:
        """``compute()``'s answer to the tenant's ``question`` of ``kind``, computed at most
        once per ``ttl_s`` and never beside another of the tenant's."""
        answer = self._kept(tenant, kind, question)
        if answer is not None:
            return answer
        async with self.reads.turn(tenant, "aggregates"):
            answer = self._kept(tenant, kind, question)  # computed while this one waited
            if answer is None:
                answer = await compute()
                if self.ttl_s > 0:
                    self._answers.put((tenant, kind), (question, answer))
            return answer

    def _kept(self, tenant: str, kind: str, question: Hashable) -> Any:
        found, kept = self._answers.get((tenant, kind))
        return kept[1] if found and kept[0] == question else None

    @property
    def tenants_in_progress(self) -> int:
        return self.reads.in_progress


async def success_rates(engine: AsyncEngine, cache: TimedCache) -> dict[tuple[str, str], float]:
    """Per (agent_id, version): the share of tasks finished in the window that succeeded.
    Every submit asks; one query a ``cache.ttl_s`` answers them. It reads every tenant's
    tasks of the window (0.19 s for 500,000 of them), and at each expiry the submits arriving
    meanwhile each sent it again, all at once: they share one now (``TimedCache.computed``)."""
    return await cache.computed("success_rates", lambda: _success_rates(engine))  # type: ignore[no-any-return]


# The failures that count against an agent's health: its own crash or time limit, a worker
# lost under it, transient errors past their retries, an answer that is no JSON, and a remote
# agent that could not be reached, did not answer in time, broke its stream off or answered
# out of protocol or with a 5xx. An agent's deliberate refusal (its own
# error code: the input was wrong), a caller's cancel and a caller's deadline do not: they
# are the caller's doing, and one tenant's would steer every tenant's routing (an audit,
# 2026-12-06: 30 tasks pinned to the fast agent and cancelled, or given a deadline of
# 800 ms, sent another tenant's tasks to the slow one, 32 of 40 instead of 18).
AGENT_FAULTS = (
    "agent_error",
    "timeout",
    "worker_lost",
    "transient_error",
    "agent_unreachable",
    "agent_protocol",
    "agent_timeout",
    "agent_stream_broken",
    "result_invalid",
)
# A deadline counts as the caller's when the task ended at it (give or take the clocks').
DEADLINE_SLACK_S = 1.0
_SUCCESS_RATES = text(
    "SELECT agent_id, agent_version, avg(CASE WHEN status = :expired"
    "   OR (status = :failed AND (error->>'code' = ANY(:faults)"
    "       OR error->>'code' LIKE 'agent\\_http\\_5%')) THEN 0 ELSE 1 END) AS rate"
    " FROM tasks WHERE finished_at > now() - make_interval(secs => :window)"
    " AND agent_id IS NOT NULL AND status <> :cancelled"
    " AND NOT (status = :expired AND deadline_at IS NOT NULL"
    "          AND finished_at >= deadline_at - make_interval(secs => :slack))"
    " GROUP BY agent_id, agent_version"
).bindparams(expired=EXPIRED, failed=FAILED, cancelled=CANCELLED)


async def _success_rates(engine: AsyncEngine) -> dict[tuple[str, str], float]:
    """Per agent and version, the share of its finished tasks of the window that it did not
    fail (``AGENT_FAULTS``), of those whose end was not the caller's doing."""
    params = {"window": WINDOW_S, "faults": list(AGENT_FAULTS), "slack": DEADLINE_SLACK_S}
    async with engine.connect() as conn:
        rows = (await conn.execute(_SUCCESS_RATES, params)).all()
    return {(r.agent_id, r.agent_version): float(r.rate) for r in rows}


# The tasks a key's patterns (``Principal.sees``) allow, by the capability each asked for
# (as every read of tasks, ``broker.tasks.queries.allowed_by``): :wide for "*", :exact the
# names, :stems those of "<stem>.*", which allows the stem and every name under it. The
# figures count tasks by the capability that served them: a key allowed ``invoice.extract``
# alone was shown the counts, success rate and times of its tenant's tasks of
# ``invoice.extract.private`` served there, which it may not read.
SEEN = (
    "(:wide OR capability = ANY(CAST(:exact AS text[]))"
    " OR capability = ANY(CAST(:stems AS text[]))"
    " OR EXISTS (SELECT FROM unnest(CAST(:stems AS text[])) AS stem"
    "            WHERE starts_with(capability, stem || '.')))"
)


def seen_by(patterns: Sequence[str]) -> dict[str, Any]:
    """The parameters of ``SEEN`` for ``patterns``."""
    return {
        "wide": "*" in patterns,
        "exact": [p for p in patterns if not p.endswith(".*") and p != "*"],
        "stems": [p[:-2] for p in patterns if p.endswith(".*")],
    }


async def capability_figures(
    engine: AsyncEngine, tenant: str, patterns: Sequence[str]
) -> dict[str, dict[str, Any]]:
    """Per capability served, over the last five minutes of the tenant's finished tasks that
    ``patterns`` allow."""
    # SEEN is this module's constant; the patterns are parameters.
    query = text(
        # A card queue is "<capability>@<agent>@<version>": figures are per capability.
        "SELECT split_part(queue, '@', 1) AS capability, count(*) AS tasks,"  # noqa: S608
        " avg((status = :succeeded)::int) AS success_rate,"
        " percentile_cont(0.5) WITHIN GROUP (ORDER BY run_s) AS p50_s,"
        " percentile_cont(0.95) WITHIN GROUP (ORDER BY run_s) AS p95_s"
        " FROM (SELECT *, extract(epoch FROM finished_at - started_at) AS run_s FROM tasks"
        "       WHERE finished_at > now() - make_interval(secs => :window)"
        f"       AND tenant = :tenant AND started_at IS NOT NULL AND {SEEN}) AS finished"
        " GROUP BY 1"
    ).bindparams(succeeded=SUCCEEDED)
    params = {"window": WINDOW_S, "tenant": tenant, **seen_by(patterns)}
    async with engine.connect() as conn:
        rows = (await conn.execute(query, params)).all()
    return {
        r.capability: {
            "tasks": r.tasks,
            "success_rate": round(float(r.success_rate), 4),
            "p50_run_s": round(float(r.p50_s), 4),
            "p95_run_s": round(float(r.p95_s), 4),
        }
        for r in rows
    }


SERIES_WINDOW_S = 3600
SERIES_STEP_S = 60
# What a caller may ask: at most a day of minutes (1441 buckets).
SERIES_WINDOW_MIN_S, SERIES_WINDOW_MAX_S = 60, 24 * 3600
SERIES_STEP_MIN_S, SERIES_STEP_MAX_S = 60, 3600
# Buckets are aligned on multiples of the step since the epoch, so a refresh moves the axis
# by whole buckets and a bucket's start never shifts. The first bucket is the one holding
# ``now() - window``, the last the one holding ``now()`` (still filling): each one whole.
SERIES_QUERY = text(
    "WITH axis AS ("  # noqa: S608 (SEEN is this module's constant)
    "  SELECT generate_series("
    "    date_bin(make_interval(secs => :step_s), now() - make_interval(secs => :window_s),"
    "             TIMESTAMPTZ 'epoch'),"
    "    date_bin(make_interval(secs => :step_s), now(), TIMESTAMPTZ 'epoch'),"
    "    make_interval(secs => :step_s)) AS start_at"
    "), ran AS ("
    "  SELECT date_bin(make_interval(secs => :step_s), finished_at, TIMESTAMPTZ 'epoch')"
    "           AS start_at, status,"
    "         extract(epoch FROM finished_at - started_at) AS run_s,"
    "         extract(epoch FROM finished_at - created_at) AS total_s"
    "  FROM tasks"
    # Spelled as ix_tasks_tenant_served_finished_at has it, so that the planner uses it.
    "  WHERE tenant = :tenant AND split_part(queue, '@', 1) = :capability"
    f"    AND started_at IS NOT NULL AND {SEEN}"
    "    AND finished_at >= date_bin(make_interval(secs => :step_s),"
    "                                now() - make_interval(secs => :window_s),"
    "                                TIMESTAMPTZ 'epoch')"
    ")"
    " SELECT axis.start_at, grouping(axis.start_at) = 1 AS is_total,"
    "  count(ran.status) AS tasks,"
    "  count(*) FILTER (WHERE ran.status = :succeeded) AS succeeded,"
    "  count(*) FILTER (WHERE ran.status = :failed) AS failed,"
    "  percentile_cont(0.5) WITHIN GROUP (ORDER BY ran.run_s) AS p50_run_s,"
    "  percentile_cont(0.95) WITHIN GROUP (ORDER BY ran.run_s) AS p95_run_s,"
    "  percentile_cont(0.5) WITHIN GROUP (ORDER BY ran.total_s) AS p50_total_s,"
    "  percentile_cont(0.95) WITHIN GROUP (ORDER BY ran.total_s) AS p95_total_s"
    " FROM axis LEFT JOIN ran ON ran.start_at = axis.start_at"
    " GROUP BY GROUPING SETS ((axis.start_at), ())"
    " ORDER BY axis.start_at"
).bindparams(succeeded=SUCCEEDED, failed=FAILED)
_FIGURES = ("p50_run_s", "p95_run_s", "p50_total_s", "p95_total_s")


async def capability_series(
    engine: AsyncEngine,
    tenant: str,
    capability: str,
    *,
    window_s: int,
    step_s: int,
    patterns: Sequence[str],
) -> dict[str, Any]:
    """The tenant's tasks of ``capability`` that ``patterns`` allow (by the capability each
    asked for) over the last ``window_s``, in buckets of
    ``step_s`` by when they finished: per bucket (every one, an empty one as zeros) the tasks
    that ran, how many succeeded and failed (the rest were cancelled or expired once started),
    and the median and 95th percentile of their run time (started to finished) and total time
    (accepted to finished), None without tasks; ``total``: the same over every bucket."""
    params = {
        "tenant": tenant,
        "capability": capability,
        "window_s": window_s,
        "step_s": step_s,
        **seen_by(patterns),
    }
    async with engine.connect() as conn:
        rows = (await conn.execute(SERIES_QUERY, params)).all()
    (total,) = [r for r in rows if r.is_total]
    return {
        "capability": capability,
        "window_s": window_s,
        "step_s": step_s,
        "total": _bucket(total),
        "buckets": [{"start_at": iso(r.start_at), **_bucket(r)} for r in rows if not r.is_total],
    }


def _bucket(row: Row[Any]) -> dict[str, Any]:
    figures = {name: getattr(row, name) for name in _FIGURES}
    return {
        "tasks": row.tasks,
        "succeeded": row.succeeded,
        "failed": row.failed,
        **{name: None if v is None else round(float(v), 4) for name, v in figures.items()},
    }
