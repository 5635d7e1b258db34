"""The model-latency phase: agents that wait on a model, as real agents do.

A loopback model (``reach.fakemodel``, a subprocess of the run) answers each call after
``MODEL_DELAY_S``. N tasks each make one call to it, through:

- A-threads: bare Celery, threads pool, urllib3;
- A-gevent: bare Celery, gevent pool, urllib3 (the fastest client measured for each pool);
- Agent-Reach: the API and one worker process on the threads pool, running the example
  async agent ``llm.complete`` (aiohttp) on its event loop.

Figures for each: tasks/s for N tasks submitted at once, one clock from the first send to the
last result, with what became of them (accepted, succeeded, errors); the most calls the model
held at once meanwhile, as it counted them; the worker's peak RSS during the N tasks; CPU per
task done of the worker and of every process on the system's side (the publisher or HTTP
client, Agent-Reach's API, the model, Postgres and Redis); the time each call adds to the
model's, one call at a time (round trip minus the delay). Beside them, the model alone: the
same request made straight to it, one at a time, by the benchmark's own client (round trip
minus the delay). Every system's added latency holds that much: the model's own answer, not the
broker's work.

Each series of round trips is followed by as many of the same calls to the model answering
at once (``reach.fakemodel``'s ``instant`` model): ``added_latency_instant``. After
the model's half second of quiet every process on a call's path has slept; the instant
series is the same path without that quiet, so the two tell the work on the path from what
waking it costs.

Then the noop figure (N echo tasks) on one threads-pool process, right after bare Celery's
prefork noop run at the same N: its target's ratio is read between those two runs.
"""

from __future__ import annotations

import asyncio
import json
import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import httpx
import psutil

from bench import alone, bareapp, baseline, loadgen, machine, report
from bench.environment import Stores
from bench.machine import Meter
from bench.plan import Plan
from bench.processes import BIN, Child, Children, celery_worker, child_env, free_port, wait_until
from bench.reach import outcome as reach_outcome
from bench.reach import throughput, wait_final
from bench.stack import running_stack
from bench.stats import RoundTrips, rate
from reach.fakemodel import INSTANT

MODEL_DELAY_S = 0.5
PROMPT = "say hello to the benchmark"
RSS_SAMPLE_S = 0.05


def measure(
    stores: Stores, children: Children, plan: Plan, progress: Callable[[str], None], meter: Meter
) -> dict[str, Any]:
    port = free_port()
    model = children.start(
        "fakemodel",
        [
            str(BIN / "python"),
            "-m",
            "reach.fakemodel",
            f"--port={port}",
            f"--delay={MODEL_DELAY_S}",
        ],
        child_env(),
    )
    base = f"http://127.0.0.1:{port}"
    wait_until(lambda: _healthy(base), timeout_s=30, what="waiting for the model", child=model)
    threads, gevent, reach = plan.model_slots
    figures: dict[str, Any] = {"delay_s": MODEL_DELAY_S, "tasks": plan.model_tasks}
    try:
        figures["model_alone"] = model_alone(port, plan.model_round_trips)
        for key, pool, slots in (("a_threads", "threads", threads), ("a_gevent", "gevent", gevent)):
            progress(f"model latency, bare Celery {pool} -c {slots}: {plan.model_tasks} tasks")
            with meter.phase(f"model.{key}"):
                figures[key] = bare(stores, children, plan, pool, slots, base, model)
        progress(f"model latency, Agent-Reach async -c {reach}: {plan.model_tasks} tasks")
        with meter.phase("model.reach"):
            figures["reach"] = agent_reach(stores, children, plan, reach, base, model)
        progress(f"noop, bare Celery prefork -c {plan.concurrency}: {plan.tasks} tasks")
        with meter.phase("model.noop_prefork"):
            figures["noop_prefork"] = noop_prefork(stores, children, plan)
        progress(f"noop on the threads pool, one process -c {reach}: {plan.tasks} tasks")
        with meter.phase("model.noop_threads"):
            figures["noop_threads"] = noop_threads(stores, children, plan, reach)
    finally:
        children.stop(model)
    return figures


def model_alone(port: int, round_trips: int) -> dict[str, Any]:
    """The model's own round trip, minus the delay: the request ``llm.complete`` sends, made
    straight to the model one at a time on one keep-alive connection; then the same
    request to the model answering at once, as many times after them."""
    samples = RoundTrips(MODEL_DELAY_S)
    with loadgen.Caller(port, "none") as caller:
        caller.post("/v1/chat/completions", _completion(INSTANT))  # connected before the clock
        for _, instant in samples.series(round_trips):
            request = _completion(INSTANT if instant else "default")
            with samples.timed(instant=instant):
                answer = caller.post("/v1/chat/completions", request)
            if answer.status != 200:
                raise RuntimeError(f"the model answered {answer.status}: {answer.body!r}")
    return samples.figures()


def _completion(model: str) -> dict[str, Any]:
    """The request ``llm.complete`` sends the model for the benchmark's payload."""
    return {
        "model": model,
        "messages": [{"role": "user", "content": PROMPT}],
        "max_tokens": 256,
        "stream": False,
    }


def _healthy(base: str) -> bool:
    try:
        return httpx.get(f"{base}/healthz", timeout=1).status_code == 200
    except httpx.HTTPError:
        return False


@contextmanager
def peak_rss(*children: Child) -> Iterator[dict[str, Any]]:
    """The largest RSS of ``children`` and their descendants together while the block runs,
    in MB (``mb``), and how many readings it is of (``samples``). A reading is taken at the
    start, every ``RSS_SAMPLE_S`` and at the end; one that finds no process, or loses one
    between listing and reading it, is no reading: ``mb`` stays None until there is one, so
    a worker that was gone reads as unmeasured, never as small."""
    peak: dict[str, Any] = {"mb": None, "samples": 0}
    stop = threading.Event()

    def one() -> None:
        processes = [p for child in children for p in child.family()]
        if not processes:
            return
        try:
            total = sum(process.memory_info().rss for process in processes)
        except psutil.Error:
            return
        mb = round(total / 2**20, 1)
        peak["mb"] = mb if peak["mb"] is None else max(peak["mb"], mb)
        peak["samples"] += 1

    def sample() -> None:
        one()
        while not stop.wait(RSS_SAMPLE_S):
            one()

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    try:
        yield peak
    finally:
        stop.set()
        sampler.join()
        one()


def _model_stats(base: str) -> dict[str, Any]:
    answer = httpx.get(f"{base}/stats", timeout=5)
    answer.raise_for_status()
    stats: dict[str, Any] = answer.json()
    return stats


def _reset(base: str) -> None:
    httpx.post(f"{base}/stats/reset", timeout=5).raise_for_status()


def bare(
    stores: Stores,
    children: Children,
    plan: Plan,
    pool: str,
    slots: int,
    base: str,
    model: Child,
) -> dict[str, Any]:
    url = f"{base}/v1/chat/completions"
    app = bareapp.create_app(stores.redis_url, stores.redis_url)
    call = app.tasks[bareapp.MODEL_TASK]
    env = child_env(BENCH_BROKER_URL=stores.redis_url, BENCH_RESULT_BACKEND=stores.redis_url)
    worker = celery_worker(
        children, f"bench-model-{pool}", "bench.bareapp", bareapp.MODEL_QUEUE, slots, env, pool
    )
    try:
        deadline = time.monotonic() + 60
        while True:  # consuming, and its connections made
            try:
                call.apply_async((url, PROMPT), queue=bareapp.MODEL_QUEUE).get(timeout=5)
                break
            except Exception:
                if time.monotonic() > deadline or not worker.alive():
                    raise
        store = baseline.RedisResults(stores.redis_url)
        _reset(base)
        with (
            machine.cpu_spent(worker=worker.cpu_s, model=model.cpu_s) as spent,
            peak_rss(worker) as peak,
        ):
            started = time.perf_counter()
            ids = [
                call.apply_async((url, PROMPT), queue=bareapp.MODEL_QUEUE).id
                for _ in range(plan.model_tasks)
            ]
            done = baseline.wait_stored(ids, store)  # raises if one has no result
            elapsed = time.perf_counter() - started
        held = _model_stats(base)["in_flight_max"]
        store.close()
        samples = RoundTrips(MODEL_DELAY_S)
        for _, instant in samples.series(plan.model_round_trips):
            model_name = INSTANT if instant else "default"
            with samples.timed(instant=instant):
                call.apply_async((url, PROMPT, model_name), queue=bareapp.MODEL_QUEUE).get(30)
    finally:
        children.stop(worker)
        app.close()
    outcome = {"tasks": plan.model_tasks, "accepted": len(ids), "succeeded": done, "errors": 0}
    return _figures(outcome, elapsed, spent, peak, held, samples, pool=pool, slots=slots)


def agent_reach(
    stores: Stores, children: Children, plan: Plan, slots: int, base: str, model: Child
) -> dict[str, Any]:
    with running_stack(
        stores,
        children,
        slots,
        queues="echo,llm.complete",
        pool="threads",
        REACH_MODEL_URL=base,
    ) as stack:
        token = stack.key("bench-model")
        envelope: dict[str, Any] = {"capability": "llm.complete", "payload": {"prompt": PROMPT}}
        # Warm-up and round trips on a tenant of their own: the N tasks are counted by tenant.
        with loadgen.Caller(stack.port, stack.key("bench-model-trips")) as caller:
            _sync(caller, envelope)  # the agent's session made before the clock
            _reset(base)
            with (
                machine.cpu_spent(
                    api=stack.api.cpu_s, worker=stack.worker.cpu_s, model=model.cpu_s
                ) as spent,
                peak_rss(stack.worker) as peak,
            ):
                submitted = asyncio.run(
                    loadgen.accept_rate(
                        stack.port, token, envelope, connections=64, requests=plan.model_tasks
                    )
                )
                counts = wait_final(stack.stores.libpq_url, "bench-model", submitted["accepted"])
                elapsed = loadgen.sent_from(submitted)
            held = _model_stats(base)["in_flight_max"]
            samples = RoundTrips(MODEL_DELAY_S)
            instant = {**envelope, "payload": {**envelope["payload"], "model": INSTANT}}
            for _, at_once in samples.series(plan.model_round_trips):
                with samples.timed(instant=at_once):
                    _sync(caller, instant if at_once else envelope)
    outcome = reach_outcome(plan.model_tasks, submitted, counts)
    figures = _figures(outcome, elapsed, spent, peak, held, samples)
    return {**figures, "pool": "threads (async handler)", "slots": slots, "statuses": counts}


def noop_prefork(stores: Stores, children: Children, plan: Plan) -> dict[str, Any]:
    """Baseline A's noop throughput figure (bare Celery, prefork, ``-c concurrency``, Redis
    results), made again right before ``noop_threads``: the machine's speed changes from one
    minute to the next (``bench.machine.loop_s``), so the ratio is read between these two
    runs, not against baseline A's run at the start."""
    app = bareapp.create_app(stores.redis_url, stores.redis_url)
    env = child_env(BENCH_BROKER_URL=stores.redis_url, BENCH_RESULT_BACKEND=stores.redis_url)
    worker = celery_worker(
        children, "bench-noop-prefork", "bench.bareapp", bareapp.QUEUE, plan.concurrency, env
    )
    try:
        baseline.warm_up(app, worker_alive=worker.alive, rounds=4 * plan.concurrency)
        with machine.cpu_spent(worker=worker.cpu_s) as spent:
            figures = baseline.throughput(
                app, plan.tasks, lambda: baseline.RedisResults(stores.redis_url)
            )
    finally:
        children.stop(worker)
        app.close()
    done = figures["succeeded"]
    return {**figures, **machine.per_task_ms(spent, done), "pool": "prefork"}


def noop_threads(stores: Stores, children: Children, plan: Plan, slots: int) -> dict[str, Any]:
    """The existing throughput figure (N echo tasks) with the worker as an async agent's
    would run: one process, the threads pool."""
    with running_stack(stores, children, slots, queues="echo", pool="threads") as stack:
        figures: dict[str, Any] = throughput(
            stack, plan.tasks, plan.submitters, tenant="bench-noop-threads"
        )
        return {**figures, "pool": "threads", "slots": slots}


def _sync(caller: loadgen.Caller, envelope: dict[str, Any]) -> None:
    answer = caller.post("/tasks", {**envelope, "reply_mode": "sync"})
    task = answer.json()
    if answer.status != 200 or task.get("status") != "succeeded":
        raise RuntimeError(f"llm.complete answered {answer.status}: {json.dumps(task)}")


def _figures(
    outcome: dict[str, int],
    elapsed: float,
    spent: dict[str, float],
    peak: dict[str, Any],
    held: int,
    samples: RoundTrips,
    **more: Any,
) -> dict[str, Any]:
    """One system's figures. ``in_flight_max``: the most calls the model held at once during
    the N tasks, as the model counted them: the slots a worker was given are not calls made.
    CPU per task of every process on the system's side (``machine.cpu_spent``), by task
    done."""
    done = outcome["succeeded"]
    return {
        **more,
        **outcome,
        "elapsed_s": round(elapsed, 3),
        "tasks_per_s": rate(done, elapsed),
        "in_flight_max": held,
        **machine.per_task_ms(spent, done),
        "worker_rss_peak_mb": peak["mb"],
        "worker_rss_samples": peak["samples"],
        **samples.figures(),
    }


def main(argv: list[str] | None = None) -> int:
    """``python -m bench.model``: this phase alone, at the full run's size."""
    return alone.run(
        argv,
        key="model",
        description=__doc__,
        measure=measure,
        title=lambda plan: (
            f"Model latency: {plan.model_tasks} tasks, each one call to a model answering"
            f" after {MODEL_DELAY_S * 1000:.0f} ms"
        ),
        table=report.model_table,
    )


if __name__ == "__main__":
    sys.exit(main())
