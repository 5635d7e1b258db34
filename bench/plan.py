"""How much of everything one run does: the full run and the ``--quick`` one for CI."""

from __future__ import annotations

import argparse
from dataclasses import asdict, dataclass, replace
from typing import Any


@dataclass(frozen=True)
class Plan:
    tasks: int  # N: the throughput figures
    concurrency: int  # C: worker processes, the same for every system
    publishes: int  # apply_async calls timed for the publish-rate figure
    round_trips: int  # sequential round trips (Celery .get(), sync mode)
    submitters: int  # concurrent HTTP submitters for the throughput figure
    stream_trips: int  # sequential stream-mode POSTs (time to first event)
    emit_tasks: int  # streamed text.summarize tasks, five outputs each
    connections: tuple[int, ...]  # accept-rate runs, one per connection count
    accept_requests: tuple[int, ...]  # POSTs sent in each of those runs
    streams: int  # SSE streams held open at once
    hold_s: float  # how long they are held
    quiet_wait_s: float  # how long to wait for a quiet machine before starting
    model_tasks: int  # model-latency phase: tasks, each one call to the loopback model
    model_round_trips: int  # ... calls one at a time, for the latency each system adds
    model_slots: tuple[int, int, int]  # ... calls at once: A-threads, A-gevent, Agent-Reach
    remote_tasks: int  # remote-agent phase: calls to the loopback HTTP agent
    remote_round_trips: int  # ... calls one at a time, for the latency the bridge adds
    remote_slots: int  # ... calls at once, direct and through the bridge
    remote_hold_s: float  # ... each call of the holding figure (slots calls open at once)
    remote_curve: tuple[int, ...]  # ... fewer calls at once, direct and through one bridge
    remote_steady_tasks: int  # ... more calls, at remote_slots at once: past the first waves
    remote_pairs: int  # ... runs of the N calls, each direct then through one bridge

    def describe(self) -> dict[str, Any]:
        return asdict(self)


def full(tasks: int = 2000, concurrency: int = 2) -> Plan:
    connections = (64, 1000)
    return Plan(
        tasks=tasks,
        concurrency=concurrency,
        publishes=max(tasks, 1000),
        round_trips=200,
        submitters=64,
        stream_trips=100,
        emit_tasks=20,
        connections=connections,
        accept_requests=tuple(max(tasks, 3 * c) for c in connections),
        streams=1000,
        hold_s=10.0,
        quiet_wait_s=300.0,
        model_tasks=2000,
        model_round_trips=30,
        model_slots=(200, 500, 500),
        remote_tasks=2000,
        remote_round_trips=30,
        remote_slots=1000,
        remote_hold_s=10.0,
        remote_curve=(100, 250, 500),
        remote_steady_tasks=10_000,
        remote_pairs=3,
    )


def quick(tasks: int = 20, concurrency: int = 2) -> Plan:
    return Plan(
        tasks=tasks,
        concurrency=concurrency,
        publishes=100,
        round_trips=10,
        submitters=8,
        stream_trips=5,
        emit_tasks=2,
        connections=(8, 50),
        accept_requests=(40, 100),
        streams=50,
        hold_s=1.0,
        quiet_wait_s=0.0,
        model_tasks=20,
        model_round_trips=3,
        model_slots=(10, 20, 20),
        remote_tasks=20,
        remote_round_trips=3,
        remote_slots=20,
        remote_hold_s=1.0,
        remote_curve=(10,),
        remote_steady_tasks=40,
        remote_pairs=2,
    )


def from_args(args: argparse.Namespace) -> Plan:
    preset = quick if args.quick else full
    plan = preset(**{k: v for k, v in (("tasks", args.n), ("concurrency", args.concurrency)) if v})
    overrides: dict[str, Any] = {}
    if args.round_trips:
        overrides["round_trips"] = args.round_trips
    if args.streams:
        overrides["streams"] = args.streams
    if args.connections:
        connections = tuple(int(c) for c in args.connections.split(","))
        overrides["connections"] = connections
        overrides["accept_requests"] = tuple(max(plan.tasks, 3 * c) for c in connections)
    if args.quiet_wait is not None:
        overrides["quiet_wait_s"] = args.quiet_wait
    return replace(plan, **overrides)
