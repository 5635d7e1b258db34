"""The remote and model phases' tables, from figures made up here: the arithmetic of their
ratios and ceilings, without a run."""

from __future__ import annotations

from typing import Any

from bench import report


def remote(cores: int | None = 2) -> dict[str, Any]:
    cpu = {"agent_cpu_ms_per_task": 0.1}
    return {
        "cores": cores,
        "direct": {
            "tasks_per_s": 2000.0,
            "in_flight_max": 1000,
            "added_latency": {"p50_ms": 1.5, "p99_ms": 2.0},
            "caller_cpu_ms_per_task": 0.4,
            **cpu,
        },
        "a_threads": {
            "pool": "threads",
            "slots": 1000,
            "tasks_per_s": 300.0,
            "in_flight_max": 90,
            "added_latency": {"p50_ms": 6.0, "p99_ms": 100.0},
            "worker_rss_peak_mb": 80.0,
            "worker_cpu_ms_per_task": 3.0,
            "services_cpu_ms_per_task": 0.4,
            **cpu,
        },
        "bridge": {
            "slots": 1000,
            "tasks_per_s": 1500.0,
            "in_flight_max": 400,
            "added_latency": {"p50_ms": 12.0, "p99_ms": 20.0},
            "bridge_rss_peak_mb": 150.0,
            "bridge_cpu_ms_per_task": 0.8,
            "services_cpu_ms_per_task": 0.1,
            "held": {"call_s": 10, "in_flight_max": 1000, "bridge_rss_peak_mb": 160.0},
            "paired": {
                "pairs": [
                    {"direct": 2000.0, "bridge": 1500.0, "ratio": 0.75},
                    {"direct": 1600.0, "bridge": 1440.0, "ratio": 0.9},
                    {"direct": 1800.0, "bridge": 1440.0, "ratio": 0.8},
                ],
                "ratio": 0.8,
            },
            **cpu,
        },
    }


def throughput_target(r: dict[str, Any]) -> dict[str, Any]:
    def target(name: str, value: float | None, limit: float, at_least: bool) -> dict[str, Any]:
        return {"target": name, "value": value}

    (check,) = [c for c in report.remote_targets(r, target) if "throughput" in c["target"]]
    return check


def row(table: str, name: str) -> list[str]:
    line = next(line for line in table.splitlines() if line.startswith(f"| {name}"))
    return [cell.strip() for cell in line.strip("|").split("|")]


def figures(table: str, name: str) -> str:
    """A row's direct, first bare pool's and bridge's cells, and its bridge / direct ratio."""
    return " ".join(row(table, name)[2:6])


def test_the_ceilings_are_what_one_core_and_every_core_allow_at_each_ones_cpu_a_call() -> None:
    table = report.remote_table({"remote": remote()})
    # one process's core: 1,000 ms over the caller's, the worker's, the bridge's CPU a call
    assert figures(table, "most calls/s, the process's one core") == "2,500 333 1,250 0.50x"
    # two cores over every process's CPU a call: 0.4 + 0.1; 3.0 + 0.1 + 0.4; 0.8 + 0.1 + 0.1
    assert figures(table, "most calls/s, the machine's 2 cores") == "4,000 571 2,000 0.50x"


def test_without_the_cores_only_the_process_ceiling_is_shown() -> None:
    table = report.remote_table({"remote": remote(cores=None)})
    assert "most calls/s, the process's one core" in table
    assert "most calls/s, the machine's" not in table


def test_the_target_is_the_median_of_the_paired_runs_not_the_first_direct_run() -> None:
    table = report.remote_table({"remote": remote()})
    assert figures(table, "throughput, run 2: direct, then bridge") == "1,600 — 1,440 0.90x"
    assert row(table, "bridge / direct, median of the 3 runs")[-2] == "0.80x"
    check = throughput_target(remote())
    assert check["value"] == 0.8 and "median of 3 runs" in check["target"]


def test_a_run_from_before_the_pairs_is_read_against_its_direct_run() -> None:
    older = remote()
    del older["bridge"]["paired"]
    check = throughput_target(older)
    assert check["value"] == 0.75 and "the phase's direct run" in check["target"]
    assert "median" not in report.remote_table({"remote": older})


def test_the_instant_round_trips_get_a_row_of_their_own_beside_the_waited_ones() -> None:
    figures_now = remote()
    for key, p50 in (("direct", 0.4), ("a_threads", 2.0), ("bridge", 5.0)):
        figures_now[key]["added_latency_instant"] = {"p50_ms": p50, "p99_ms": p50 * 2}
    table = report.remote_table({"remote": figures_now})
    instant = row(table, "added latency p50, the agent answering at once")
    # direct, A-threads, bridge; bridge / direct; bridge / best A
    assert instant[2:] == ["0.4", "2", "5", "12.50x", "2.50x"]
    assert row(table, "added latency p50")[2:5] == ["1.5", "6", "12"]


def test_a_run_from_before_the_instant_round_trips_shows_none() -> None:
    table = report.remote_table({"remote": remote()})
    assert row(table, "added latency p50, the agent answering at once")[2:] == ["—"] * 5


def model(instant: bool) -> dict[str, Any]:
    def system(slots: int, waited: float, at_once: float) -> dict[str, Any]:
        latency = {"added_latency": {"p50_ms": waited, "p99_ms": waited * 2}}
        if instant:
            latency["added_latency_instant"] = {"p50_ms": at_once, "p99_ms": at_once * 2}
        return {
            "slots": slots,
            "tasks_per_s": 300.0,
            "worker_rss_peak_mb": 100.0,
            "worker_cpu_ms_per_task": 1.0,
            **latency,
        }

    alone = {"added_latency": {"p50_ms": 1.5, "p99_ms": 2.0}}
    if instant:
        alone["added_latency_instant"] = {"p50_ms": 0.5, "p99_ms": 0.7}
    return {
        "model_alone": alone,
        "a_threads": system(200, 6.0, 3.0),
        "a_gevent": system(500, 8.0, 4.0),
        "reach": system(500, 12.0, 4.5),
        "noop_threads": {"tasks_per_s": 1000.0},
    }


def test_the_model_table_reads_the_instant_round_trips_against_the_best_bare_pool() -> None:
    table = report.model_table({"model": model(instant=True)})
    # the model alone, A-threads, A-gevent, Agent-Reach, Reach / best A
    assert row(table, "added latency p50, the model answering at once")[2:] == [
        "0.5",
        "3",
        "4",
        "4.5",
        "1.50x",
    ]
    assert row(table, "added latency p50")[2:] == ["1.5", "6", "8", "12", "2.00x"]
    older = report.model_table({"model": model(instant=False)})
    assert row(older, "added latency p50, the model answering at once")[2:] == ["—"] * 5
