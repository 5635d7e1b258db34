"""The remote-agent phase: an HTTP agent called through the bridge, against calling it directly.

A loopback agent (``reach.fakemodel``'s ``POST /run``, the ``http`` protocol) answers each
call after ``REMOTE_DELAY_S``. Two ways to make N calls to it, ``slots`` at a time:

- **direct**: one aiohttp session on one event loop, ``slots`` calls in flight, with the
  bridge's own runtime (``as_the_bridge``): its event loop (uvloop) and its garbage
  collector's threshold (without them it made 16-20 % fewer calls a second here);
- **A-threads, A-gevent**: bare Celery, what a user would otherwise run: N tasks queued, then
  one worker process (threads or gevent pool, ``-c <slots>``) whose task makes the same call
  with urllib3 (``bench.bareapp.agent_call``), results in Redis;
- **Agent-Reach**: the agent registered (``PUT /agents/...``), N tasks queued through the API,
  then one bridge worker process (``celery -A workers.bridge worker -P threads -c <slots>``)
  calling it.

Figures: calls (tasks) per second, from the agent's first call to the last result (the
drain: the tasks were queued before the worker or bridge started); for the bridge also submit
to final: N tasks POSTed through the API to a bridge already running and warm, one clock from
the first POST to the last task final, the API's intake and every process's CPU included
(the issue's figure, and the target's); what became of each run's tasks; the time
each call adds to the agent's, one call at a time (the direct call's round trip, Celery's
``apply_async(...).get()`` and our sync round trip, minus the delay), then as many of the
same calls answered at once (the payload's ``delay_s`` 0; ``added_latency_instant``: the
path without the quiet of the wait); the most calls the agent
saw in flight at once; the worker's (bridge's) peak RSS and CPU per task. Then the holding
figure: ``slots`` calls of ``remote_hold_s`` each (long enough for all of them to be open),
submitted together, and the most the agent saw open at once.

The machine's speed changes from one second to the next (``bench.machine.loop_s``), so the
target's ratio is read between runs made seconds apart: a direct run of the N calls right
before each bridge drain and the submit-to-final run that follows it on the same bridge,
``remote_pairs`` pairs in all (the main run is the first), and the median of their ratios. Then
the same N tasks through two bridge processes started together (``-n`` names of their own,
``slots / 2`` calls at once each; a direct run right before them); then ``remote_steady_tasks``
calls, ``slots`` at once, direct and through one bridge: N = 2,000 at 1,000 at once is two
waves for the direct caller, whose ramps weigh on its rate, so the longer run shows the rates
once both have settled; and, both ways, at each of ``remote_curve``'s smaller numbers of calls
at once: where one bridge process stops keeping up with the agent.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import os
import statistics
import sys
import time
from collections.abc import Callable, Coroutine, Iterator
from dataclasses import replace
from typing import Any

import aiohttp
import httpx
import psycopg
import redis

from bench import alone, bareapp, baseline, loadgen, machine, report
from bench.environment import Stores
from bench.machine import Meter
from bench.model import peak_rss
from bench.plan import Plan
from bench.processes import (
    BIN,
    Child,
    Children,
    celery_worker,
    child_env,
    free_port,
    wait_until,
)
from bench.reach import outcome, wait_final
from bench.stack import running_stack
from bench.stats import RoundTrips, rate
from broker import runtime
from broker.settings import Settings
from broker.tasks.dispatch import redis_lists

REMOTE_DELAY_S = 0.2
CAPABILITY = "bench.remote"
AGENT_ID = "bench-remote"
PAYLOAD = {"i": 0}
ENVELOPE: dict[str, Any] = {"capability": CAPABILITY, "payload": PAYLOAD}
QUEUES_OF = "SELECT DISTINCT queue FROM tasks WHERE tenant = %s"
CALLS_PER_INSTANCE = "SELECT instance, count(*) FROM tasks WHERE tenant = %s GROUP BY 1"


def measure(
    stores: Stores, children: Children, plan: Plan, progress: Callable[[str], None], meter: Meter
) -> dict[str, Any]:
    port = free_port()
    agent = children.start(
        "remote-agent",
        [
            str(BIN / "python"),
            "-m",
            "reach.fakemodel",
            f"--port={port}",
            f"--delay={REMOTE_DELAY_S}",
        ],
        child_env(),
    )
    base = f"http://127.0.0.1:{port}"
    wait_until(lambda: _stats(base) is not None, timeout_s=30, what="the agent", child=agent)
    figures: dict[str, Any] = {
        "delay_s": REMOTE_DELAY_S,
        "tasks": plan.remote_tasks,
        "cores": os.cpu_count(),
    }
    try:
        progress(f"remote agent, direct: {plan.remote_tasks} calls, {plan.remote_slots} at once")
        with meter.phase("remote.direct"):
            figures["direct"] = as_the_bridge(direct(base, plan, agent))
        for pool in ("threads", "gevent"):
            progress(f"remote agent, bare Celery {pool} -c {plan.remote_slots}")
            with meter.phase(f"remote.a_{pool}"):
                figures[f"a_{pool}"] = bare(stores, children, plan, base, agent, pool)
        best = max(("threads", "gevent"), key=lambda pool: figures[f"a_{pool}"]["tasks_per_s"])
        progress(f"remote agent, through the bridge -c {plan.remote_slots}")
        with meter.phase("remote.bridge"):
            figures["bridge"] = bridged(stores, children, plan, base, agent, progress, best)
    finally:
        children.stop(agent)
    return figures


def bridge_runtime() -> dict[str, Any]:
    """What the bridge's process runs on unless its operator says otherwise (the benchmark
    sets neither): its event loop, and the youngest generation's collection threshold."""
    fields = Settings.model_fields
    return {
        "event_loop": fields["event_loop"].default,
        "gc_gen0_threshold": fields["gc_gen0_threshold"].default,
    }


def as_the_bridge(call: Coroutine[Any, Any, dict[str, Any]]) -> dict[str, Any]:
    """A direct run, on the bridge's runtime (``bridge_runtime``): the best a caller could do
    is what the bridge does for itself, so the ratio is the broker's work alone. On
    asyncio's loop and Python's own threshold the same caller spent 28-40 % more CPU a call
    here, and made 16-20 % fewer calls a second (``docs/performance.md``)."""
    chosen = bridge_runtime()
    before = gc.get_threshold()
    runtime.tune_collector(chosen["gc_gen0_threshold"])
    try:
        with asyncio.Runner(
            loop_factory=lambda: runtime.new_event_loop(chosen["event_loop"])
        ) as runner:
            figures = runner.run(call)
            figures["runtime"] = {
                "event_loop": type(runner.get_loop()).__module__.split(".")[0],
                "gc_gen0_threshold": gc.get_threshold()[0],
            }
            return figures
    finally:
        gc.set_threshold(*before)


def _stats(base: str) -> dict[str, Any] | None:
    try:
        answer = httpx.get(f"{base}/stats", timeout=1)
        return answer.json() if answer.status_code == 200 else None
    except httpx.HTTPError:
        return None


def _reset(base: str) -> None:
    httpx.post(f"{base}/stats/reset", timeout=5).raise_for_status()


def _body(i: int, instant: bool = False) -> dict[str, Any]:
    """A call of the ``http`` protocol, as the bridge makes it; ``instant``: the agent
    answers it without its delay (the payload's ``delay_s``)."""
    return {
        "task_id": f"direct-{i}",
        "capability": CAPABILITY,
        "payload": {"i": i, "delay_s": 0} if instant else {"i": i},
        "attempt": 1,
        "deadline_at": None,
        "session": None,
        "metadata": {},
    }


async def direct(base: str, plan: Plan, agent: Child, round_trips: bool = True) -> dict[str, Any]:
    """The agent called straight from one event loop: the best a caller could do. CPU per
    call: this process's (the caller's) and the agent's. ``round_trips``: then the calls one
    at a time, for the latency of a call."""
    _reset(base)
    connector = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=connector) as session:
        url = f"{base}/run"

        async def one(i: int, instant: bool = False) -> None:
            async with session.post(url, json=_body(i, instant)) as answer:
                answer.raise_for_status()
                await answer.read()

        gate = asyncio.Semaphore(plan.remote_slots)

        async def gated(i: int) -> None:
            async with gate:
                await one(i)

        await asyncio.gather(*(one(-i - 1) for i in range(min(50, plan.remote_slots))))  # warm
        _reset(base)
        started = time.perf_counter()
        cpu_at_start = time.process_time(), agent.cpu_s()
        await asyncio.gather(*(gated(i) for i in range(plan.remote_tasks)))
        elapsed = time.perf_counter() - started
        caller_s, agent_s = time.process_time() - cpu_at_start[0], agent.cpu_s() - cpu_at_start[1]
        in_flight_max = (_stats(base) or {}).get("in_flight_max", 0)
        samples = RoundTrips(REMOTE_DELAY_S)
        for i, instant in samples.series(plan.remote_round_trips if round_trips else 0):
            with samples.timed(instant=instant):
                await one(i, instant)
    figures = {
        "calls": plan.remote_tasks,
        # Any call answered with an error, or not at all, raises above: every one succeeded.
        "tasks": plan.remote_tasks,
        "accepted": plan.remote_tasks,
        "succeeded": plan.remote_tasks,
        "errors": 0,
        "elapsed_s": round(elapsed, 3),
        "tasks_per_s": rate(plan.remote_tasks, elapsed),
        "in_flight_max": in_flight_max,
        "caller_cpu_ms_per_task": round(caller_s * 1000 / plan.remote_tasks, 3),
        "agent_cpu_ms_per_task": round(agent_s * 1000 / plan.remote_tasks, 3),
        **samples.figures(),
    }
    return figures


def bare(
    stores: Stores,
    children: Children,
    plan: Plan,
    base: str,
    agent: Child,
    pool: str,
    round_trips: bool = True,
) -> dict[str, Any]:
    """Bare Celery calling the agent: N tasks queued while no worker runs, then one worker
    process on ``pool`` with ``remote_slots`` slots takes them, timed as the bridge is.
    ``round_trips``: then the calls one at a time, for the latency Celery adds."""
    url = f"{base}/run"
    app = bareapp.create_app(stores.redis_url, stores.redis_url)
    call = app.tasks[bareapp.AGENT_TASK]
    env = child_env(BENCH_BROKER_URL=stores.redis_url, BENCH_RESULT_BACKEND=stores.redis_url)
    store = baseline.RedisResults(stores.redis_url)
    worker = None
    try:
        ids = [
            call.apply_async((url, _body(i)), queue=bareapp.AGENT_QUEUE).id
            for i in range(plan.remote_tasks)
        ]
        _reset(base)
        worker = celery_worker(
            children,
            f"bench-remote-{pool}",
            "bench.bareapp",
            bareapp.AGENT_QUEUE,
            plan.remote_slots,
            env,
            pool,
        )
        wait_until(
            lambda: (_stats(base) or {}).get("first_at") is not None,
            timeout_s=60,
            what="the bare worker's first call",
            child=worker,
            every_s=0.005,
        )
        cpu_at_start = worker.cpu_s(), agent.cpu_s(), machine.services_cpu()
        with peak_rss(worker) as peak:
            done = baseline.wait_stored(ids, store)  # raises if one has no result
            finished_at = time.time()
        cpu_s, agent_s = worker.cpu_s() - cpu_at_start[0], agent.cpu_s() - cpu_at_start[1]
        services_s = machine.services_cpu_since(cpu_at_start[2])
        stats = _stats(base) or {}
        elapsed = finished_at - (stats.get("first_at") or finished_at)
        samples = RoundTrips(REMOTE_DELAY_S)
        for i, instant in samples.series(plan.remote_round_trips if round_trips else 0):
            with samples.timed(instant=instant):
                call.apply_async((url, _body(i, instant)), queue=bareapp.AGENT_QUEUE).get(30)
    finally:
        store.close()
        if worker is not None:
            children.stop(worker)
        app.close()
        with redis.Redis.from_url(stores.redis_url) as client:  # nothing left for the next run
            client.delete(bareapp.AGENT_QUEUE)
    counted = {"tasks": plan.remote_tasks, "accepted": len(ids), "succeeded": done, "errors": 0}
    figures = _run_figures("worker", counted, elapsed, stats, peak, cpu_s, agent_s, services_s)
    return {"pool": pool, "slots": plan.remote_slots, **figures, **samples.figures()}


def _run_figures(
    process: str,
    outcome: dict[str, int],
    elapsed: float,
    stats: dict[str, Any],
    peak: dict[str, Any],
    cpu_s: float,
    agent_s: float,
    services_s: float,
) -> dict[str, Any]:
    """One run's figures: what became of its tasks (``outcome``), the rate, the most calls
    the agent saw at once, and the CPU a call done of the ``process`` ("worker", "bridge")
    doing them, the agent, and Postgres and Redis (shared services: rough, as in the
    throughput figure)."""
    done = outcome["succeeded"]

    def per_call(seconds: float) -> float:
        return round(seconds * 1000 / max(1, done), 3)

    return {
        **outcome,
        "elapsed_s": round(elapsed, 3),
        "tasks_per_s": rate(done, elapsed),
        "in_flight_max": stats.get("in_flight_max", 0),
        f"{process}_rss_peak_mb": peak["mb"],
        f"{process}_rss_samples": peak["samples"],
        f"{process}_cpu_ms_per_task": per_call(cpu_s),
        "services_cpu_ms_per_task": per_call(services_s),
        "agent_cpu_ms_per_task": per_call(agent_s),
    }


def hold(stack: Any, base: str, plan: Plan, bridge: Any) -> dict[str, Any]:
    """How many calls one bridge process holds open at once: ``slots`` tasks whose calls
    take ``remote_hold_s`` each, submitted together; the most the agent saw in flight, and
    the bridge's RSS meanwhile."""
    _reset(base)
    envelope = {"capability": CAPABILITY, "payload": {"delay_s": plan.remote_hold_s}}
    with peak_rss(bridge) as peak:
        submitted = asyncio.run(
            loadgen.accept_rate(
                stack.port,
                stack.key("bench-remote-hold"),
                envelope,
                connections=64,
                requests=plan.remote_slots,
            )
        )
        counts = wait_final(stack.stores.libpq_url, "bench-remote-hold", submitted["accepted"])
    return {
        "calls": plan.remote_slots,
        "call_s": plan.remote_hold_s,
        **outcome(plan.remote_slots, submitted, counts),
        "statuses": counts,
        "in_flight_max": (_stats(base) or {}).get("in_flight_max", 0),
        "bridge_rss_peak_mb": peak["mb"],
        "bridge_rss_samples": peak["samples"],
    }


def _bridge(children: Children, env: dict[str, str], slots: int, name: str) -> Any:
    return children.start(
        name,
        [
            str(BIN / "celery"),
            "-A",
            "workers.bridge",
            "worker",
            "-P",
            "threads",
            "-c",
            str(slots),
            "-n",
            f"{name}@%h",
            "--without-gossip",
            "--without-mingle",
            "-l",
            "WARNING",
        ],
        env,
    )


class Bridged:
    """The agent registered on one stack, and runs of N queued tasks served by bridge
    processes started afresh for each run."""

    def __init__(self, stores: Stores, children: Children, stack: Any, base: str) -> None:
        self.children, self.stack, self.base = children, stack, base
        self.env = child_env(
            REACH_DATABASE_URL=stores.database_url,
            REACH_REDIS_URL=stores.redis_url,
            REACH_REMOTE_HEALTH_INTERVAL_S="1",
        )
        self.ops = httpx.Client(
            base_url=stack.url,
            timeout=60,
            headers={"Authorization": f"Bearer {stack.operator_key('bench-remote-ops')}"},
        )
        self.trips = loadgen.Caller(stack.port, stack.key("bench-remote-trips"))
        self.runs = 0

    def close(self) -> None:
        self.ops.close()
        self.trips.close()

    def sync_call(self, instant: bool = False) -> loadgen.Response:
        """One sync call through the bridge; ``instant``: the agent answers it at once."""
        envelope = {**ENVELOPE, "reply_mode": "sync"}
        if instant:
            envelope["payload"] = {**PAYLOAD, "delay_s": 0}
        return self.trips.post("/tasks", envelope)

    def register(self, slots: int) -> None:
        """The agent registered, and served once by a bridge that then stops: its lease
        holds for the tasks queued next."""
        registration = {
            "version": "1.0.0",
            "endpoint": {"protocol": "http", "url": f"{self.base}/run"},
            "capabilities": [{"capability": CAPABILITY, "timeout_s": 60, "idempotent": True}],
        }
        self.ops.put(f"/agents/{AGENT_ID}", json=registration).raise_for_status()
        first = _bridge(self.children, self.env, slots, "bench-bridge-a")
        wait_until(
            lambda: self.sync_call().status == 200,
            timeout_s=60,
            what="the bridge to serve the agent",
            child=first,
        )
        self.children.stop(first)

    def run(
        self, agent: Child, tasks: int, slots: int, bridges: int = 1, keep: bool = False
    ) -> tuple[dict[str, Any], list[Any]]:
        """N tasks queued while no bridge runs, then ``bridges`` fresh bridge processes
        (``slots`` calls at once between them) started together, and the tasks given to them
        once each one consumes the queue (``gate``): the figure is what the bridges do with
        that many calls to make, not how fast the API feeds them, nor how fast one boots.
        ``keep``: the bridges are left running (and returned) for more figures."""
        self.runs += 1
        tenant = f"bench-remote-{self.runs}"
        submitted = asyncio.run(
            loadgen.accept_rate(
                self.stack.port, self.stack.key(tenant), ENVELOPE, connections=64, requests=tasks
            )
        )
        each = max(1, slots // bridges)
        stores = self.stack.stores
        with held_aside(stores.libpq_url, stores.redis_url, tenant, submitted["accepted"]):
            started = [
                _bridge(self.children, self.env, each, f"bench-bridge-{self.runs}{chr(97 + i)}")
                for i in range(bridges)
            ]
            self.until_consuming(started)
            _reset(self.base)
        # Their CPU from the first call on: booting (imports, Celery's start) is not a call's.
        wait_until(
            lambda: (_stats(self.base) or {}).get("first_at") is not None,
            timeout_s=60,
            what="the bridge's first call",
            child=started[0],
            every_s=0.005,
        )
        cpu_at_start = (
            sum(b.cpu_s() for b in started),
            agent.cpu_s(),
            machine.services_cpu(),
        )
        with peak_rss(*started) as peak:
            counts = wait_final(self.stack.stores.libpq_url, tenant, submitted["accepted"])
            finished_at = time.time()
        cpu_s = sum(b.cpu_s() for b in started) - cpu_at_start[0]
        agent_s = agent.cpu_s() - cpu_at_start[1]
        services_s = machine.services_cpu_since(cpu_at_start[2])
        stats = _stats(self.base) or {}
        if not keep:
            for bridge in started:
                self.children.stop(bridge)
        elapsed = finished_at - (stats.get("first_at") or finished_at)
        done = outcome(tasks, submitted, counts)
        figures = _run_figures("bridge", done, elapsed, stats, peak, cpu_s, agent_s, services_s)
        with psycopg.connect(self.stack.stores.libpq_url) as conn:
            shares: dict[str, int] = dict(conn.execute(CALLS_PER_INSTANCE, (tenant,)).fetchall())
        calls = {"statuses": counts, "calls_per_bridge": shares}
        return {"slots": slots, "bridges": bridges, **calls, **figures}, started

    def submit_to_final(self, agent: Child, bridge: Child, tasks: int) -> dict[str, Any]:
        """N tasks through the API to a bridge process already running and warm (it has just
        made a run's calls), on one clock from the first POST to the last task final: what a
        caller of the API sees, the API's intake and the queue included, as the direct
        caller's clock runs from its first send to its last answer. CPU per call of every
        process on the way (``machine.cpu_spent``). ``run`` times the bridge alone."""
        self.runs += 1
        tenant = f"bench-remote-{self.runs}"
        token = self.stack.key(tenant)
        _reset(self.base)
        with (
            machine.cpu_spent(
                api=self.stack.api.cpu_s, bridge=bridge.cpu_s, agent=agent.cpu_s
            ) as spent,
            peak_rss(bridge) as peak,
        ):
            submitted = asyncio.run(
                loadgen.accept_rate(
                    self.stack.port, token, ENVELOPE, connections=64, requests=tasks
                )
            )
            counts = wait_final(self.stack.stores.libpq_url, tenant, submitted["accepted"])
            elapsed = loadgen.sent_from(submitted)
        done = outcome(tasks, submitted, counts)
        return {
            **done,
            "statuses": counts,
            "submit_s": submitted["elapsed_s"],
            "elapsed_s": round(elapsed, 3),
            "tasks_per_s": rate(done["succeeded"], elapsed),
            "in_flight_max": (_stats(self.base) or {}).get("in_flight_max", 0),
            "bridge_rss_peak_mb": peak["mb"],
            "bridge_rss_samples": peak["samples"],
            **machine.per_task_ms(spent, done["succeeded"]),
        }

    def until_consuming(self, bridges: list[Child]) -> None:
        """Calls answered at once, one after another, until each bridge has made one: then
        each one consumes the queue. Redis hands a message to the client that has waited
        longest, so they take turns."""
        names = {f"bench-bridge-{self.runs}{chr(97 + i)}@" for i in range(len(bridges))}
        seen: set[str] = set()

        def each_has_called() -> bool:
            answer = self.sync_call(instant=True)
            if answer.status == 200:
                seen.add(answer.json()["agent"]["instance"].partition("@")[0] + "@")
            return names <= seen

        wait_until(
            each_has_called,
            timeout_s=60,
            what="each bridge to make a call",
            child=bridges[0],
            every_s=0,
        )

    def round_trips(self, count: int) -> dict[str, dict[str, float]]:
        """``added_latency`` and ``added_latency_instant`` (``RoundTrips``)."""
        samples = RoundTrips(REMOTE_DELAY_S)
        for _, instant in samples.series(count):
            with samples.timed(instant=instant):
                answer = self.sync_call(instant)
            if answer.status != 200:
                raise RuntimeError(f"{CAPABILITY} answered {answer.status}: {answer.body!r}")
        return samples.figures()


@contextlib.contextmanager
def held_aside(libpq_url: str, redis_url: str, tenant: str, accepted: int) -> Iterator[None]:
    """The tenant's queued messages held aside while bridges start, then given back to their
    queue in one step each (``RENAME``, which wakes a waiting ``BRPOP``), in their order.
    Bridges started together boot one after the other on a busy machine, and the first one
    up took every call before the second was (two runs of two: 2,000 calls and none, and
    1,703 and 297, the second's first call 0.94 s after the first's)."""
    with psycopg.connect(libpq_url) as conn:
        queues = [q for (q,) in conn.execute(QUEUES_OF, (tenant,))]
    aside = {key: f"bench:aside:{key}" for queue in queues for key in redis_lists(queue)}
    with redis.Redis.from_url(redis_url) as client:
        for key, held in aside.items():
            if client.exists(key):
                client.rename(key, held)
        try:
            waiting = sum(client.llen(held) for held in aside.values())
            if waiting != accepted:
                raise RuntimeError(f"{waiting} messages held aside of {accepted} accepted")
            yield
        finally:
            for key, held in aside.items():
                if client.exists(held) and not client.renamenx(held, key):
                    raise RuntimeError(f"{key} was not empty when given its messages back")


def bridged(
    stores: Stores,
    children: Children,
    plan: Plan,
    base: str,
    agent: Child,
    progress: Callable[[str], None] = lambda _: None,
    bare_pool: str | None = None,
) -> dict[str, Any]:
    """Through the bridge: the main run (``remote_slots`` calls at once, one bridge process),
    its submit-to-final run, round trips and holding figure; more pairs of runs; then the same
    with two bridge processes sharing the slots; then one bridge at each of ``remote_curve``'s
    smaller numbers of calls at once, against the direct calls and bare Celery on
    ``bare_pool`` (when given) with as many."""
    # The settled run queues remote_steady_tasks at once while no bridge runs; the API
    # refuses a task once the queue holds max_queue_depth (10,000 by default), so one message
    # left from an earlier figure would turn a task of a 10,000-task run into a 503. And the
    # API reads the depth up to 5 s late, counting its own admissions since: a run right after
    # another was read as that one's tasks still queued beside its own (at the quick size, 11
    # of 40 refused against a bound of twice 40).
    most = max(plan.remote_steady_tasks, plan.remote_tasks, plan.remote_slots)
    depth = str(4 * most)
    with running_stack(stores, children, 1, queues="echo", REACH_MAX_QUEUE_DEPTH=depth) as stack:
        runs = Bridged(stores, children, stack, base)
        try:
            runs.register(plan.remote_slots)
            pair, figures, bridge = _paired_runs(runs, base, plan, agent)
            pairs = [pair]
            try:
                figures["submit_to_final"] = pair.pop("submit_figures")
                figures.update(runs.round_trips(plan.remote_round_trips))
                figures["held"] = hold(stack, base, plan, bridge)
            finally:
                children.stop(bridge)
            for _ in range(plan.remote_pairs - 1):
                progress("remote agent, direct then through the bridge, once more")
                pair, _, bridge = _paired_runs(runs, base, plan, agent)
                children.stop(bridge)
                pair.pop("submit_figures")
                pairs.append(pair)
            figures["paired"] = {
                "pairs": pairs,
                "ratio": round(statistics.median(p["ratio"] for p in pairs), 3),
                "submit_ratio": round(statistics.median(p["submit_ratio"] for p in pairs), 3),
            }
            progress(f"remote agent, through two bridges -c {plan.remote_slots // 2} each")
            before = as_the_bridge(direct(base, plan, agent, round_trips=False))
            figures["two_bridges"], _ = runs.run(
                agent, plan.remote_tasks, plan.remote_slots, bridges=2
            )
            figures["two_bridges"]["direct_tasks_per_s"] = before["tasks_per_s"]
            steady = plan.remote_steady_tasks
            progress(f"remote agent, {steady} calls: direct, then one bridge")
            longer = replace(plan, remote_tasks=steady)
            figures["steady"] = {
                "calls": steady,
                "direct": as_the_bridge(direct(base, longer, agent)),
                "bridge": runs.run(agent, steady, plan.remote_slots)[0],
            }
            curve = []
            for slots in plan.remote_curve:
                progress(f"remote agent, {slots} at once: direct, bare Celery, the bridge")
                fewer = replace(plan, remote_slots=slots)
                point: dict[str, Any] = {"slots": slots}
                point["direct"] = as_the_bridge(direct(base, fewer, agent))
                if bare_pool is not None:
                    point["bare"] = bare(
                        stores, children, fewer, base, agent, bare_pool, round_trips=False
                    )
                point["bridge"], _ = runs.run(agent, plan.remote_tasks, slots)
                curve.append(point)
            figures["curve"] = curve
        finally:
            runs.close()
    return figures


def _paired_runs(
    runs: Bridged, base: str, plan: Plan, agent: Child
) -> tuple[dict[str, Any], dict[str, Any], Child]:
    """A direct run of the N calls, then right after it the bridge's two figures for them:
    the drain (``Bridged.run``: the bridge alone, the tasks queued before it starts) and
    submit to final (``Bridged.submit_to_final``: through the API to that bridge, now warm).
    The pair; the drain run's figures; the bridge, still running, for the caller to stop."""
    before = as_the_bridge(direct(base, plan, agent, round_trips=False))
    drained, (bridge,) = runs.run(agent, plan.remote_tasks, plan.remote_slots, keep=True)
    submitted = runs.submit_to_final(agent, bridge, plan.remote_tasks)
    pair = {
        **_pair(before, drained),
        "submit_to_final": submitted["tasks_per_s"],
        "submit_ratio": _versus(submitted, before),
        # What became of each run's tasks: a ratio of a run that lost some is no figure.
        "outcomes": {
            key: _outcome(run) for key, run in (("bridge", drained), ("submit_to_final", submitted))
        },
        "submit_figures": submitted,
    }
    return pair, drained, bridge


def _outcome(run: dict[str, Any]) -> dict[str, int]:
    return {key: run[key] for key in ("tasks", "accepted", "succeeded", "errors")}


def _versus(bridge: dict[str, Any], direct: dict[str, Any]) -> float:
    return round(float(bridge["tasks_per_s"]) / max(float(direct["tasks_per_s"]), 0.1), 3)


def _pair(direct: dict[str, Any], bridge: dict[str, Any]) -> dict[str, Any]:
    """A bridge run and the direct run made right before it. The machine's speed changes
    from one second to the next (``bench.machine.loop_s``), so a ratio is read between runs
    made seconds apart, never between the phase's first run and one a minute later."""
    return {
        "direct": direct["tasks_per_s"],
        "bridge": bridge["tasks_per_s"],
        "ratio": _versus(bridge, direct),
    }


def main(argv: list[str] | None = None) -> int:
    """``python -m bench.remote``: this phase alone, at the full run's size."""
    return alone.run(
        argv,
        key="remote",
        description=__doc__,
        measure=measure,
        title=lambda plan: (
            f"Remote agent: {plan.remote_tasks} calls to an HTTP agent answering after"
            f" {REMOTE_DELAY_S * 1000:.0f} ms, {plan.remote_slots} at once"
        ),
        table=report.remote_table,
    )


if __name__ == "__main__":
    sys.exit(main())
