"""The benchmark runs end to end at a tiny size and reports every figure. No timing is
asserted: figures from a CI machine say nothing, but a benchmark that no longer runs does."""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from bench import alone
from bench import remote as remote_module
from bench import report as report_module
from bench.plan import quick

ROOT = Path(__file__).resolve().parents[2]


def run_bench(module: str, *args: str, timeout_s: float = 280) -> str:
    """``python -m <module> <args>`` from the project's root; its standard output, once it
    has exited 0."""
    done = subprocess.run(
        [sys.executable, "-m", module, *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=timeout_s,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    return done.stdout


@pytest.fixture(scope="module")
def report(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    out = tmp_path_factory.mktemp("bench") / "quick.json"
    assert "Targets:" in run_bench("bench", "--quick", "--json", str(out), timeout_s=600)
    result: dict[str, Any] = json.loads(out.read_text())
    return result


def positive(value: object) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and value > 0


def assert_latency(summary: dict[str, Any], samples: int, quantiles: tuple[str, ...]) -> None:
    assert summary["samples"] == samples
    for q in quantiles:
        assert positive(summary[f"{q}_ms"]), (q, summary)


@pytest.mark.timeout(660)
def test_quick_run_measures_both_baselines(report: dict[str, Any]) -> None:
    plan = report["meta"]["plan"]
    for key in ("baseline_a", "baseline_b"):
        figures = report[key]
        assert figures["publish"]["calls"] == plan["publishes"]
        assert positive(figures["publish"]["calls_per_s"])
        assert figures["throughput"]["succeeded"] == plan["tasks"]
        assert positive(figures["throughput"]["tasks_per_s"])
        assert positive(figures["throughput"]["worker_cpu_ms_per_task"])
        # Can be 0 at smoke size: the services' CPU clocks tick in 10 ms steps.
        assert figures["throughput"]["services_cpu_ms_per_task"] >= 0
        assert_latency(figures["round_trip"], plan["round_trips"], ("p50", "p95", "p99"))


@pytest.mark.timeout(660)
def test_quick_run_measures_every_agent_reach_figure(report: dict[str, Any]) -> None:
    plan, reach = report["meta"]["plan"], report["reach"]
    throughput = reach["throughput"]
    assert throughput["accepted"] == throughput["succeeded"] == plan["tasks"]
    assert throughput["errors"] == 0
    assert positive(throughput["tasks_per_s"])
    assert positive(throughput["all_cpu_ms_per_task"])
    assert positive(throughput["api_cpu_ms_per_task"])
    assert positive(throughput["worker_cpu_ms_per_task"])
    assert throughput["services_cpu_ms_per_task"] >= 0
    assert_latency(reach["sync_round_trip"], plan["round_trips"], ("p50", "p95", "p99"))
    assert_latency(reach["stream_first_event"], plan["stream_trips"], ("p50", "p95"))
    assert_latency(reach["emit_to_frame"], 5 * plan["emit_tasks"], ("p50", "p95"))
    assert [run["connections"] for run in reach["accept"]] == plan["connections"]
    for run, requests in zip(reach["accept"], plan["accept_requests"], strict=True):
        answered = sum(run["statuses"].values())
        assert answered + run["timeouts"] + run["connection_errors"] == requests
        assert positive(run["accepted_per_s"])
        assert positive(run["latency"]["p99_ms"])
    streams = reach["streams"]
    assert streams["opened"] == plan["streams"]
    assert isinstance(streams["held_to_the_end"], int)
    assert positive(streams["rss_peak_mb"])
    assert positive(reach["api_rss_idle_mb"])


@pytest.mark.timeout(660)
def test_quick_run_reports_ratios_and_targets(report: dict[str, Any]) -> None:
    assert report["ratios"]
    assert all(positive(ratio) for ratio in report["ratios"].values()), report["ratios"]
    assert report["targets"]
    assert all(isinstance(check["met"], bool) for check in report["targets"])
    # a target not met for a reason other than its value says the reason
    assert all(isinstance(c.get("because", ""), str) for c in report["targets"])
    assert all(isinstance(cores, float) for cores in report["foreign_cores"].values())
    assert report["meta"]["date"]
    # the machine's speed at the run's start and end, to read one run beside another
    assert positive(report["meta"]["loop_s"]["start"]) and positive(report["meta"]["loop_s"]["end"])


@pytest.mark.timeout(660)
def test_quick_run_measures_the_model_latency_phase(report: dict[str, Any]) -> None:
    plan, model = report["meta"]["plan"], report["model"]
    for key, slots in zip(("a_threads", "a_gevent", "reach"), plan["model_slots"], strict=True):
        figures = model[key]
        assert figures["slots"] == slots
        tasks = plan["model_tasks"]
        assert (figures["accepted"], figures["succeeded"], figures["errors"]) == (tasks, tasks, 0)
        assert positive(figures["tasks_per_s"])
        # All N tasks go at once and each call waits 500 ms: the model holds every slot
        assert figures["in_flight_max"] == min(slots, tasks), (key, figures)
        assert positive(figures["worker_rss_peak_mb"]) and figures["worker_rss_samples"] > 0
        assert positive(figures["worker_cpu_ms_per_task"])
        # every process on the system's side, so more than the worker alone
        assert figures["all_cpu_ms_per_task"] > figures["worker_cpu_ms_per_task"], figures
        assert_latency(figures["added_latency"], plan["model_round_trips"], ("p50", "p99"))
    # the model's own round trip, the floor of every system's added latency
    assert_latency(model["model_alone"]["added_latency"], plan["model_round_trips"], ("p50", "p99"))
    # each system's round trips, and the model's own, also to the model answering at once
    for key in ("model_alone", "a_threads", "a_gevent", "reach"):
        instant = model[key]["added_latency_instant"]
        assert_latency(instant, plan["model_round_trips"], ("p50", "p99"))
    named = [c for c in report["targets"] if c["target"].startswith("model latency")]
    assert len(named) == 3
    rss = next(c for c in named if "RSS" in c["target"])
    # the quick size holds 20 calls, not 500: the RSS target cannot be met, and says so
    assert (
        not rss["met"]
        and f"held {min(plan['model_slots'][2], plan['model_tasks'])}" in (rss["target"])
    )
    noop, prefork = model["noop_threads"], model["noop_prefork"]
    for figures in (noop, prefork):
        assert figures["accepted"] == figures["succeeded"] == plan["tasks"]
        assert figures["errors"] == 0 and positive(figures["tasks_per_s"])
    (noop_check,) = [c for c in report["targets"] if c["target"].startswith("noop")]
    assert "run right before" in noop_check["target"]
    assert noop_check["value"] == round(noop["tasks_per_s"] / prefork["tasks_per_s"], 3)
    # ``python -m bench.model`` prints the phase's table alone: its own prefork run beside
    alone = report_module.model_table({"model": model}).splitlines()
    noop_row = next(line for line in alone if line.startswith("| noop throughput"))
    assert "run right before" in noop_row
    assert report_module._cell(prefork["tasks_per_s"]) in noop_row
    assert report_module._cell(noop["tasks_per_s"]) in noop_row
    p50_row = next(line for line in alone if line.startswith("| added latency p50"))
    floor = report_module._cell(model["model_alone"]["added_latency"]["p50_ms"])
    assert p50_row.split("|")[3].strip() == floor


@pytest.mark.timeout(660)
def test_quick_run_measures_the_remote_agent_phase(report: dict[str, Any]) -> None:
    plan, remote = report["meta"]["plan"], report["remote"]
    direct, bridge = remote["direct"], remote["bridge"]
    assert direct["calls"] == bridge["succeeded"] == plan["remote_tasks"], remote
    for figures in (direct, bridge):
        assert positive(figures["tasks_per_s"])
        assert 0 < figures["in_flight_max"] <= plan["remote_slots"]
        assert_latency(figures["added_latency"], plan["remote_round_trips"], ("p50", "p99"))
        instant = figures["added_latency_instant"]  # the agent answering at once
        assert_latency(instant, plan["remote_round_trips"], ("p50", "p99"))
    assert bridge["slots"] == plan["remote_slots"]
    # bare Celery calling the same agent, on each pool, as many calls at once
    for pool in ("threads", "gevent"):
        bare = remote[f"a_{pool}"]
        assert (bare["pool"], bare["slots"]) == (pool, plan["remote_slots"])
        assert bare["succeeded"] == plan["remote_tasks"]
        assert positive(bare["tasks_per_s"]) and positive(bare["worker_cpu_ms_per_task"])
        assert positive(bare["worker_rss_peak_mb"]) and positive(bare["agent_cpu_ms_per_task"])
        assert 0 < bare["in_flight_max"] <= plan["remote_slots"]
        assert_latency(bare["added_latency"], plan["remote_round_trips"], ("p50", "p99"))
        assert_latency(bare["added_latency_instant"], plan["remote_round_trips"], ("p50", "p99"))
    held = bridge["held"]
    assert held["statuses"] == {"succeeded": plan["remote_slots"]}
    assert 0 < held["in_flight_max"] <= plan["remote_slots"]
    assert positive(bridge["bridge_rss_peak_mb"])
    assert positive(bridge["bridge_cpu_ms_per_task"])
    assert positive(bridge["agent_cpu_ms_per_task"])
    # Postgres's and Redis's CPU is read in 10 ms ticks: a tiny run may see none of them
    assert bridge["services_cpu_ms_per_task"] >= 0
    assert positive(direct["caller_cpu_ms_per_task"])
    assert positive(direct["agent_cpu_ms_per_task"])
    # every direct run on the bridge's own event loop and collector threshold
    directs = [direct, bridge["steady"]["direct"], *(p["direct"] for p in bridge["curve"])]
    assert {json.dumps(d["runtime"], sort_keys=True) for d in directs} == {
        json.dumps(remote_module.bridge_runtime(), sort_keys=True)
    }
    named = [c["target"] for c in report["targets"] if c["target"].startswith("remote agent")]
    assert len(named) == 3
    # the target's ratio: each bridge run against a direct run made right before it, the
    # main run first, and the median of those ratios
    paired = bridge["paired"]
    assert len(paired["pairs"]) == plan["remote_pairs"]
    assert paired["pairs"][0]["bridge"] == bridge["tasks_per_s"]
    submitted = bridge["submit_to_final"]  # the main pair's: through the API, bridge warm
    assert paired["pairs"][0]["submit_to_final"] == submitted["tasks_per_s"]
    assert submitted["statuses"] == {"succeeded": plan["remote_tasks"]}
    assert submitted["accepted"] == plan["remote_tasks"] and submitted["errors"] == 0
    assert 0 < submitted["in_flight_max"] <= plan["remote_slots"]
    assert positive(submitted["api_cpu_ms_per_task"])
    assert submitted["all_cpu_ms_per_task"] > submitted["bridge_cpu_ms_per_task"]
    for pair in paired["pairs"]:
        assert positive(pair["direct"]) and positive(pair["bridge"])
        assert pair["ratio"] == round(pair["bridge"] / pair["direct"], 3)
        assert pair["submit_ratio"] == round(pair["submit_to_final"] / pair["direct"], 3)
        for outcome in pair["outcomes"].values():
            assert outcome == {
                "tasks": plan["remote_tasks"],
                "accepted": plan["remote_tasks"],
                "succeeded": plan["remote_tasks"],
                "errors": 0,
            }
    assert paired["ratio"] == round(statistics.median(p["ratio"] for p in paired["pairs"]), 3)
    assert paired["submit_ratio"] == round(
        statistics.median(p["submit_ratio"] for p in paired["pairs"]), 3
    )
    throughput = next(
        c for c in report["targets"] if "throughput" in c["target"] and "remote" in c["target"]
    )
    assert "submit to final" in throughput["target"] and "median of" in throughput["target"]
    assert throughput["value"] == paired["submit_ratio"]
    # the same N through two bridge processes sharing the slots, started together
    two = bridge["two_bridges"]
    assert (two["bridges"], two["slots"]) == (2, plan["remote_slots"])
    assert two["statuses"] == {"succeeded": plan["remote_tasks"]}
    # Each of the two made calls (the tasks wait until both consume the queue: at the full
    # size the first one up took them all while the second booted; ``test_held_aside.py``)
    assert len(two["calls_per_bridge"]) == 2 and min(two["calls_per_bridge"].values()) > 0, two
    assert positive(two["tasks_per_s"]) and positive(two["bridge_cpu_ms_per_task"])
    assert 0 < two["in_flight_max"] <= plan["remote_slots"]
    assert positive(two["direct_tasks_per_s"])  # the direct run made right before them
    # both processes' memory, so more than one bridge's alone
    assert two["bridge_rss_peak_mb"] > bridge["bridge_rss_peak_mb"], (two, bridge)
    # more calls at the same number at once, direct and through one bridge
    steady = bridge["steady"]
    assert steady["calls"] == steady["direct"]["calls"] == plan["remote_steady_tasks"]
    assert steady["bridge"]["statuses"] == {"succeeded": plan["remote_steady_tasks"]}
    assert steady["bridge"]["slots"] == plan["remote_slots"]
    for figures in (steady["direct"], steady["bridge"]):
        assert positive(figures["tasks_per_s"])
        assert 0 < figures["in_flight_max"] <= plan["remote_slots"]
    # fewer calls at once, both ways: never more in flight than asked
    assert [p["slots"] for p in bridge["curve"]] == list(plan["remote_curve"])
    best = max(("threads", "gevent"), key=lambda pool: remote[f"a_{pool}"]["tasks_per_s"])
    for point in bridge["curve"]:
        assert point["direct"]["calls"] == plan["remote_tasks"]
        assert point["bridge"]["statuses"] == {"succeeded": plan["remote_tasks"]}
        assert (point["bare"]["pool"], point["bare"]["slots"]) == (best, point["slots"])
        assert point["bare"]["succeeded"] == plan["remote_tasks"]
        for figures in (point["direct"], point["bare"], point["bridge"]):
            assert positive(figures["tasks_per_s"])
            assert 0 < figures["in_flight_max"] <= point["slots"]
    table = report_module.remote_table({"remote": remote})
    assert "| calls at once" in table and "2 bridges" in table
    assert f"throughput, {plan['remote_steady_tasks']:,} calls (settled)" in table
    assert "A-threads -c" in table and "A-gevent -c" in table and "bridge / best A" in table
    assert f"bridge / direct, drain, median of the {plan['remote_pairs']} runs" in table
    assert f"bridge / direct, submit to final, median of the {plan['remote_pairs']} runs" in table
    assert "throughput, submit to final (API included)" in table
    assert f"most calls/s, the machine's {remote['cores']} cores" in table


@pytest.mark.timeout(300)
def test_the_latency_breakdown_runs_and_reports_every_part() -> None:
    lines = run_bench("bench.latency", "--n", "3", "--burst", "5", "--delay", "0.05").splitlines()
    header = next(line for line in lines if line.startswith("| capability"))
    for part in ("accept", "to_claim", "run", "answer", "whole"):
        assert part in header
    for capability in ("echo", "llm.complete"):
        row = next(line for line in lines if line.startswith(f"| {capability} "))
        cells = [c.strip() for c in row.strip("|").split("|")[1:]]
        assert len(cells) == 5
        for cell in cells:
            p50, p95 = (float(x) for x in cell.split("/"))
            assert p95 >= p50


@pytest.mark.timeout(300)
def test_the_retention_measurement_runs_at_a_small_size() -> None:
    """``python -m bench.retention`` is run by hand at millions of rows; here at 3,000, so that
    a change to the janitor's or the listing's code cannot leave it broken."""
    figures = json.loads(
        run_bench("bench.retention", "--rows", "3000", "--batches", "2", "--samples", "5")
    )
    assert (figures["rows"], figures["expired"]) == (3000, 1500)
    assert figures["insert"]["samples"] == figures["list"]["samples"] == 5
    janitor = figures["janitor"]
    assert janitor["removed"] == 1500, janitor  # every expired row, in two batches of 1,000
    assert janitor["rows_per_s_while_running"] > 0, janitor


@pytest.mark.timeout(300)
def test_the_fairness_measurement_runs_at_a_small_size() -> None:
    """``python -m bench.fairness`` is run by hand with a flood of 3,000; here with 60, so that
    a change to the stack or the intake cannot leave it broken."""
    figures = json.loads(
        run_bench("bench.fairness", "--flood", "60", "--calm", "3", "--slice", "10")
    )
    assert (figures["flood"], figures["calm"]) == (60, 3)
    assert [run["fair_slice"] for run in figures["runs"]] == [10, 0]
    for run in figures["runs"]:
        assert run["hog_accepted"] == 60, run
        assert 0 <= run["hog_waiting_at_calm_submits"] <= 60, run
        assert run["calm_statuses"] == {"succeeded": 3}, run
        assert run["calm_wait"]["samples"] == 3, run
        assert run["calm_wait"]["max_ms"] >= run["calm_wait"]["p50_ms"] > 0, run


@pytest.mark.timeout(300)
def test_the_replay_measurement_runs_at_a_small_size() -> None:
    """``python -m bench.replay`` is run by hand over a log of 10,000 events; here of 50, so
    that a change to the streams or the event log cannot leave it broken."""
    figures = json.loads(run_bench("bench.replay", "--events", "50", "--replays", "2"))
    assert figures["events"] == 50
    replay, read = figures["replay"], figures["read"]
    assert replay["bytes_each"] > 50 * len("event: output"), replay  # every event, whole
    assert read["bytes_each"] > 0 and read["api_cpu_ms_each"] >= 0, read
    assert replay["wall_ms_each"] > 0, replay


def test_a_phase_run_alone_prints_its_table_and_the_machines_speed(
    capsys: pytest.CaptureFixture[str],
) -> None:
    seen: list[object] = []

    def measure(*args: object) -> dict[str, Any]:
        seen.append(args[2])  # the plan
        return {"calls": 3}

    code = alone.run(
        ["--quick"],
        key="phase",
        description=None,
        measure=measure,
        title=lambda plan: f"a phase of {plan.tasks} tasks",
        table=lambda result: f"| calls | {result['phase']['calls']} |",
    )
    out = capsys.readouterr().out.splitlines()
    assert code == 0 and len(seen) == 1
    assert out[:2] == [f"a phase of {quick().tasks} tasks", "| calls | 3 |"]
    assert out[2].startswith("The machine's speed: a Python loop of 5,000,000 additions took")
