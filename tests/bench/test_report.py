"""The remote and model phases' tables, from figures made up here: the arithmetic of their
ratios and ceilings, without a run."""

from __future__ import annotations

from typing import Any

from bench import report


def whole(tasks: int = 2000) -> dict[str, int]:
    """A run's tasks: every one accepted and succeeded, no error."""
    return {"tasks": tasks, "accepted": tasks, "succeeded": tasks, "errors": 0}


def remote(cores: int | None = 2) -> dict[str, Any]:
    cpu = {"agent_cpu_ms_per_task": 0.1}
    return {
        "cores": cores,
        "direct": {
            "tasks_per_s": 2000.0,
            "in_flight_max": 1000,
            "added_latency": {"p50_ms": 1.5, "p99_ms": 2.0},
            "caller_cpu_ms_per_task": 0.4,
            **whole(),
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
            "held": {
                "call_s": 10,
                "in_flight_max": 1000,
                "bridge_rss_peak_mb": 160.0,
                **whole(1000),
            },
            "submit_to_final": {"tasks_per_s": 1200.0, "all_cpu_ms_per_task": 2.5, **whole()},
            "paired": {
                "pairs": [
                    {"direct": 2000.0, "bridge": 1500.0, "ratio": 0.75},
                    {"direct": 1600.0, "bridge": 1440.0, "ratio": 0.9},
                    {"direct": 1800.0, "bridge": 1440.0, "ratio": 0.8},
                ],
                "ratio": 0.8,
            },
            **whole(),
            **cpu,
        },
    }


def with_submit_to_final(r: dict[str, Any]) -> dict[str, Any]:
    """``remote()`` as a run now makes it: each pair's drain followed by a submit-to-final
    run on the same bridge, each run's outcome beside its rate."""
    rates = (1200.0, 1520.0, 1350.0)
    for pair, rate in zip(r["bridge"]["paired"]["pairs"], rates, strict=True):
        pair["submit_to_final"] = rate
        pair["submit_ratio"] = round(rate / pair["direct"], 3)
        pair["outcomes"] = {"bridge": whole(), "submit_to_final": whole()}
    r["bridge"]["paired"]["submit_ratio"] = 0.75  # 0.6, 0.95, 0.75
    return r


def throughput_target(r: dict[str, Any]) -> dict[str, Any]:
    (check,) = [c for c in report.remote_targets(r) if "throughput" in c["target"]]
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
    assert row(table, "bridge / direct, drain, median of the 3 runs")[-2] == "0.80x"
    # a run from before submit to final: its drain figure, and the target says so
    check = throughput_target(remote())
    assert check["value"] == 0.8 and "drain only, median of 3 runs" in check["target"]


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
            "worker_rss_samples": 40,
            "in_flight_max": slots,
            "worker_cpu_ms_per_task": 1.0,
            **whole(),
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
        "noop_threads": {"tasks_per_s": 1000.0, **whole()},
        "noop_prefork": {"tasks_per_s": 1100.0, **whole()},
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


def model_check(m: dict[str, Any], starts: str) -> dict[str, Any]:
    (check,) = [c for c in report.model_targets(m) if c["target"].startswith(starts)]
    return check


def test_a_model_run_that_lost_a_task_meets_no_throughput_target() -> None:
    # Given a model phase whose Agent-Reach run rated well, but on 1,999 of its 2,000 tasks
    m = model(instant=True)
    m["reach"]["tasks_per_s"] = 900.0
    assert model_check(m, "model latency: throughput")["met"]
    m["reach"].update(succeeded=1999, errors=1)
    # When its targets are read, then the throughput one is not met, and says why
    check = model_check(m, "model latency: throughput")
    assert not check["met"]
    assert check["because"] == "incomplete: 1999 of 2000 succeeded (2000 accepted, 1 errors)"


def test_a_run_with_tasks_refused_at_the_door_is_incomplete_too() -> None:
    r = with_submit_to_final(remote())
    r["bridge"]["paired"]["submit_ratio"] = 0.95
    assert throughput_target(r)["met"]
    r["bridge"]["paired"]["pairs"][2]["outcomes"]["submit_to_final"]["accepted"] = 1999  # a 503
    check = throughput_target(r)
    assert not check["met"] and check["because"].startswith("incomplete:")


def test_a_run_that_does_not_say_what_became_of_its_tasks_is_not_counted() -> None:
    m = model(instant=True)
    m["reach"]["tasks_per_s"] = 900.0
    del m["reach"]["accepted"]
    assert not model_check(m, "model latency: throughput")["met"]


def test_the_rss_target_is_met_only_with_a_reading_and_500_calls_held() -> None:
    m = model(instant=True)
    assert model_check(m, "model latency: worker RSS")["met"]  # 100 MB, 500 held, 40 readings
    # no reading of the worker's RSS at all: no figure, not 0 MB
    m["reach"].update(worker_rss_peak_mb=None, worker_rss_samples=0)
    check = model_check(m, "model latency: worker RSS")
    assert not check["met"] and check["because"] == "the worker's RSS was never read"
    # a worker given 500 slots that the model saw hold 320 calls at most
    m["reach"].update(worker_rss_peak_mb=100.0, worker_rss_samples=40, in_flight_max=320)
    check = model_check(m, "model latency: worker RSS")
    assert not check["met"] and "held 320 at most" in check["target"]
    # a run from before the model counted its calls in flight
    del m["reach"]["in_flight_max"]
    assert not model_check(m, "model latency: worker RSS")["met"]


def test_the_noop_target_reads_the_prefork_run_made_right_before() -> None:
    m = model(instant=True)
    at_start = {"throughput": {"tasks_per_s": 2000.0, **whole()}}
    (check,) = [c for c in report.model_targets(m, at_start) if "noop" in c["target"]]
    assert check["value"] == 0.909 and "run right before" in check["target"]  # 1,000 / 1,100
    table = report.model_table({"model": m, "baseline_a": at_start})
    assert row(table, "noop throughput (A: prefork, run right before)")[3:] == [
        "1,100",
        "—",
        "1,000",
        "0.91x",
    ]
    assert row(table, "noop throughput (A: prefork, at the run's start)")[-1] == "0.50x"
    del m["noop_prefork"]  # a run from before the pair: against baseline A, as it was
    (older,) = [c for c in report.model_targets(m, at_start) if "noop" in c["target"]]
    assert older["value"] == 0.5 and "at the run's start" in older["target"]


def test_the_model_table_shows_calls_held_and_every_process_cpu() -> None:
    m = model(instant=True)
    for key, cpu in (("a_threads", 6.0), ("a_gevent", 5.0), ("reach", 7.5)):
        m[key]["all_cpu_ms_per_task"] = cpu
    table = report.model_table({"model": m})
    assert row(table, "calls in flight at most")[3:] == ["200", "500", "500", "1.00x"]
    assert row(table, "CPU per task: every process")[3:] == ["6", "5", "7.5", "1.50x"]


def test_the_remote_target_is_submit_to_final_and_the_drain_stays_beside_it() -> None:
    r = with_submit_to_final(remote())
    check = throughput_target(r)
    assert check["value"] == 0.75 and "submit to final" in check["target"]
    assert not check["met"]  # 0.75 < 0.9
    table = report.remote_table({"remote": r})
    assert row(table, "bridge / direct, submit to final, median of the 3 runs")[-2] == "0.75x"
    assert row(table, "bridge / direct, drain, median of the 3 runs")[-2] == "0.80x"
    assert figures(table, "throughput, run 2: direct, then bridge (submit to final)") == (
        "1,600 — 1,520 0.95x"
    )
    assert figures(table, "throughput, submit to final (API included)") == "2,000 — 1,200 0.60x"
