"""``python -m bench``: Agent-Reach against bare Celery, in one run, on this machine.

Finds or starts Postgres and Redis, makes a database and a Redis db of the run's own, measures
baseline A (Celery, Redis result backend), baseline B (Celery, database result backend) and
Agent-Reach (API and worker as subprocesses), prints a table and the targets, writes JSON, and
removes what it made. Every process it starts is stopped, on Ctrl-C and on failure too.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import celery
import psycopg
import redis

from bench import baseline, machine, model, reach, remote, report
from bench.environment import Stores, fresh_stores
from bench.plan import Plan, from_args
from bench.processes import ROOT, Children

RESULTS = ROOT / "bench" / "results"
QUIET_CORES = 0.25  # others may use this much CPU while we measure


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m bench", description=__doc__.splitlines()[0])
    parser.add_argument("--n", type=int, help="tasks for the throughput figures (2000)")
    parser.add_argument("--concurrency", type=int, help="worker processes, every system (2)")
    parser.add_argument(
        "--quick",
        action="store_true",
        help="tiny run for CI: 20 tasks, 10 round trips, 50 connections, 50 streams",
    )
    parser.add_argument("--json", type=Path, help="where the JSON goes (bench/results/...)")
    parser.add_argument("--round-trips", type=int, help="sequential round trips (200)")
    parser.add_argument("--connections", help="accept-rate runs, comma-separated (64,1000)")
    parser.add_argument("--streams", type=int, help="SSE streams held open (1000)")
    parser.add_argument(
        "--quiet-wait", type=float, help="seconds to wait for a quiet machine (300; quick: 0)"
    )
    parser.add_argument("--keep-logs", action="store_true", help="keep the processes' logs")
    return parser.parse_args(argv)


def progress(message: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


def _git(*args: str) -> str:
    try:
        done = subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.TimeoutExpired):
        return ""
    return done.stdout.strip() if done.returncode == 0 else ""


def describe(plan: Plan) -> dict[str, Any]:
    # diff-index only reads: it never refreshes or writes the index of a shared tree.
    dirty = subprocess.run(
        ["git", "diff-index", "--quiet", "HEAD", "--"], cwd=ROOT, capture_output=True
    ).returncode
    return {
        "date": datetime.now(UTC).isoformat(timespec="seconds"),
        "commit": _git("rev-parse", "--short", "HEAD"),
        "uncommitted_changes": dirty != 0,
        "python": platform.python_version(),
        "celery": celery.__version__,
        "cpus": os.cpu_count(),
        "platform": platform.platform(),
        "plan": plan.describe(),
    }


def _service_versions(stores: Stores) -> dict[str, Any]:
    with psycopg.connect(stores.libpq_url) as conn:
        postgres = conn.execute("SHOW server_version").fetchone()
    with redis.Redis.from_url(stores.redis_url) as client:
        redis_version = client.info("server")["redis_version"]
    return {
        "postgres": postgres[0] if postgres else None,
        "redis": redis_version,
        "embedded": list(stores.embedded),
    }


def measure(plan: Plan, log_dir: Path) -> dict[str, Any]:
    result: dict[str, Any] = {"meta": describe(plan)}
    result["meta"]["loop_s"] = {"start": machine.loop_s()}
    meter = machine.Meter()

    def wait_quiet(name: str) -> None:
        if plan.quiet_wait_s > 0:
            progress(f"waiting up to {plan.quiet_wait_s:.0f}s for a quiet machine")
        meter.foreign[f"before_{name}"] = machine.wait_quiet(plan.quiet_wait_s, QUIET_CORES)

    with fresh_stores() as stores, Children(log_dir) as children:
        result["meta"]["services"] = _service_versions(stores)
        systems = {
            "baseline_a": baseline.Baseline(
                "a",
                "A (Celery, Redis results)",
                stores.redis_url,
                stores.redis_url,
                lambda: baseline.RedisResults(stores.redis_url),
            ),
            "baseline_b": baseline.Baseline(
                "b",
                "B (Celery, database results)",
                stores.redis_url,
                "db+" + stores.database_url,
                lambda: baseline.DatabaseResults(stores.libpq_url),
            ),
        }
        for key, system in systems.items():
            wait_quiet(key)
            result[key] = baseline.measure(
                system,
                children,
                tasks=plan.tasks,
                round_trips=plan.round_trips,
                publishes=plan.publishes,
                concurrency=plan.concurrency,
                progress=progress,
                meter=meter,
            )
        wait_quiet("reach")
        result["reach"] = reach.measure(stores, children, plan, progress, meter)
        wait_quiet("model")
        result["model"] = model.measure(stores, children, plan, progress, meter)
        wait_quiet("remote")
        result["remote"] = remote.measure(stores, children, plan, progress, meter)
    result["meta"]["loop_s"]["end"] = machine.loop_s()
    result["foreign_cores"] = meter.foreign
    result["ratios"] = report.ratios(result)
    result["targets"] = report.targets(result)
    return result


def _stop_on_sigterm(signum: int, frame: object) -> None:
    raise KeyboardInterrupt  # unwinds like Ctrl-C: every context manager stops what it started


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    plan = from_args(args)
    signal.signal(signal.SIGTERM, _stop_on_sigterm)
    # Also when started with SIGINT ignored (a background job of a script): Ctrl-C still stops.
    signal.signal(signal.SIGINT, signal.default_int_handler)
    log_dir = Path(tempfile.mkdtemp(prefix="reach-bench-"))
    try:
        result = measure(plan, log_dir)
    except BaseException as exc:
        what = "stopped" if isinstance(exc, KeyboardInterrupt) else "failed"
        print(f"the run {what}; the processes' logs are in {log_dir}", file=sys.stderr)
        raise
    if args.keep_logs:
        progress(f"logs kept in {log_dir}")
    else:
        shutil.rmtree(log_dir, ignore_errors=True)
    out = args.json or RESULTS / f"bench-{datetime.now(UTC):%Y%m%dT%H%M%SZ}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    meta = result["meta"]
    print(
        f"Agent-Reach benchmark, {meta['date']}, commit {meta['commit']}"
        f"{' (+ uncommitted changes)' if meta['uncommitted_changes'] else ''}, "
        f"{meta['cpus']} CPUs, N={plan.tasks}, C={plan.concurrency}"
    )
    print(machine.speed_line(meta["loop_s"]["start"], meta["loop_s"]["end"]))
    print(report.table(result))
    print(f"\nModel latency: {plan.model_tasks} tasks, each one call answered after 500 ms")
    print(report.model_table(result))
    print(
        f"\nRemote agent: {plan.remote_tasks} calls to an HTTP agent answering after"
        f" {remote.REMOTE_DELAY_S * 1000:.0f} ms, {plan.remote_slots} at once"
    )
    print(report.remote_table(result))
    print("\nTargets:")
    print(report.target_lines(result))
    print(f"\nCores kept busy by other processes, per phase (of {meta['cpus']}):")
    print(report.foreign_lines(result))
    print(f"JSON: {out}")
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except KeyboardInterrupt:
        sys.exit(130)
