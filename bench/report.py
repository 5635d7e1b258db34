"""One run's figures as a table, each Agent-Reach figure against baseline A's counterpart, and
the issue's targets checked."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

RSS_LIMIT_MB = 300
MODEL_RSS_LIMIT_MB = 250
MODEL_RSS_IN_FLIGHT = 500  # the RSS target is for this many calls held at once
MODEL_ADDED_P50_LIMIT_MS = 10.0
REMOTE_ADDED_P50_LIMIT_MS = 5.0
REMOTE_THROUGHPUT_RATIO = 0.9


@dataclass(frozen=True)
class Row:
    figure: str
    unit: str
    a: float | None
    b: float | None
    reach: float | str | None
    vs_a: float | None  # Agent-Reach / A


def _ratio(value: float | None, base: float | None) -> float | None:
    if value is None or not base:
        return None
    return round(value / base, 3)


def incomplete(*runs: dict[str, Any]) -> str | None:
    """Why a figure made of ``runs`` is no figure, or None: each run has to show that every
    one of its ``tasks`` was accepted and succeeded, with no error. A run that lost tasks
    would be rated on those it finished; one that does not say is not counted either."""
    for run in runs:
        try:
            tasks, accepted, done = run["tasks"], run["accepted"], run["succeeded"]
            errors = run["errors"]
        except KeyError:
            return "incomplete: a run does not say how many of its tasks succeeded"
        if not accepted == done == tasks or errors:
            return f"incomplete: {done} of {tasks} succeeded ({accepted} accepted, {errors} errors)"
    return None


def row(figure: str, unit: str, a: float | None, b: float | None, reach: Any) -> Row:
    number = reach if isinstance(reach, int | float) else None
    return Row(figure, unit, a, b, reach, _ratio(number, a))


def rows(result: dict[str, Any]) -> list[Row]:
    a, b, r = result["baseline_a"], result["baseline_b"], result["reach"]
    found = [
        row(
            "throughput, N tasks to a stored result",
            "tasks/s",
            a["throughput"]["tasks_per_s"],
            b["throughput"]["tasks_per_s"],
            r["throughput"]["tasks_per_s"],
        )
    ]
    a_tp, b_tp, r_tp = a["throughput"], b["throughput"], r["throughput"]
    found.append(
        row(
            "CPU per task: worker processes",
            "ms",
            a_tp["worker_cpu_ms_per_task"],
            b_tp["worker_cpu_ms_per_task"],
            r_tp["worker_cpu_ms_per_task"],
        )
    )
    found.append(
        row(
            "CPU per task: publisher / API process",
            "ms",
            a_tp["client_cpu_ms_per_task"],
            b_tp["client_cpu_ms_per_task"],
            r_tp["api_cpu_ms_per_task"],
        )
    )
    found.append(
        row(
            "CPU per task: Postgres + Redis (shared; rough)",
            "ms",
            a_tp["services_cpu_ms_per_task"],
            b_tp["services_cpu_ms_per_task"],
            r_tp["services_cpu_ms_per_task"],
        )
    )
    found.append(
        row(
            "CPU per task: every process (client, API, worker, Postgres + Redis)",
            "ms",
            a_tp.get("all_cpu_ms_per_task"),
            b_tp.get("all_cpu_ms_per_task"),
            r_tp.get("all_cpu_ms_per_task"),
        )
    )
    for q in ("p50", "p95", "p99"):
        a_ms, b_ms = a["round_trip"][f"{q}_ms"], b["round_trip"][f"{q}_ms"]
        reach_ms = r["sync_round_trip"][f"{q}_ms"]
        found.append(row(f"round trip {q} (Celery .get() / sync mode)", "ms", a_ms, b_ms, reach_ms))
    a_pub, b_pub = a["publish"]["calls_per_s"], b["publish"]["calls_per_s"]
    for run in r["accept"]:
        label = f"publish rate, 1 process / accept rate, {run['connections']} connections"
        found.append(row(label, "/s", a_pub, b_pub, run["accepted_per_s"]))
    for run in r["accept"]:
        p99 = (run["latency"] or {}).get("p99_ms")
        found.append(row(f"accept p99, {run['connections']} connections", "ms", None, None, p99))
        errors = f"{run['errors']} (503: {run['back_pressure_503']})"
        found.append(
            row(f"accept errors, {run['connections']} connections", "", None, None, errors)
        )
    for q in ("p50", "p95"):
        first = r["stream_first_event"][f"{q}_ms"]
        a_ms = a["round_trip"][f"{q}_ms"]
        found.append(row(f"stream mode, first event {q} (A: round trip)", "ms", a_ms, None, first))
    for q in ("p50", "p95"):
        emitted = r["emit_to_frame"][f"{q}_ms"]
        found.append(row(f"emit to SSE frame {q}", "ms", None, None, emitted))
    streams = r["streams"]
    held = streams["held_to_the_end"]
    found.append(row(f"SSE streams held, of {streams['streams']}", "", None, None, held))
    found.append(row("API RSS with them open", "MB", None, None, streams["rss_peak_mb"]))
    found.append(row("API RSS idle", "MB", None, None, r["api_rss_idle_mb"]))
    return found


def ratios(result: dict[str, Any]) -> dict[str, float | None]:
    a, b, r = result["baseline_a"], result["baseline_b"], result["reach"]
    r_tp = r["throughput"]["tasks_per_s"]
    found = {
        "throughput_vs_a": _ratio(r_tp, a["throughput"]["tasks_per_s"]),
        "throughput_vs_b": _ratio(r_tp, b["throughput"]["tasks_per_s"]),
        "sync_p99_vs_b": _ratio(r["sync_round_trip"]["p99_ms"], b["round_trip"]["p99_ms"]),
    }
    for q in ("p50", "p95", "p99"):
        found[f"sync_{q}_vs_a"] = _ratio(
            r["sync_round_trip"][f"{q}_ms"], a["round_trip"][f"{q}_ms"]
        )
    for q in ("p50", "p95"):
        found[f"stream_first_event_{q}_vs_a_round_trip"] = _ratio(
            r["stream_first_event"][f"{q}_ms"], a["round_trip"][f"{q}_ms"]
        )
    for run in r["accept"]:
        found[f"accept_{run['connections']}_vs_a_publish"] = _ratio(
            run["accepted_per_s"], a["publish"]["calls_per_s"]
        )
    return found


def check(
    name: str,
    value: float | None,
    limit: float,
    at_least: bool,
    runs: tuple[dict[str, Any], ...] = (),
    because: str | None = None,
) -> dict[str, Any]:
    """One target: met when ``value`` is within ``limit``, every one of ``runs`` (the runs
    the value is made of) is complete (``incomplete``), and there is no other reason it
    cannot be read (``because``: what was not measured)."""
    because = incomplete(*runs) or because
    met = because is None and value is not None and (value >= limit if at_least else value <= limit)
    found = {"target": name, "value": value, "limit": limit, "met": met}
    return {**found, "because": because} if because is not None else found


def targets(result: dict[str, Any]) -> list[dict[str, Any]]:
    found = ratios(result)
    r, a, b = result["reach"], result["baseline_a"], result["baseline_b"]
    r_tp = r["throughput"]

    checks = [
        check(
            "end-to-end throughput >= 0.8x A",
            found["throughput_vs_a"],
            0.8,
            True,
            (r_tp, a["throughput"]),
        ),
        check("sync round trip p50 <= 2x A", found["sync_p50_vs_a"], 2.0, False),
        check("throughput >= 5x B", found["throughput_vs_b"], 5.0, True, (r_tp, b["throughput"])),
        check("sync round trip p99 <= 0.1x B's p99", found["sync_p99_vs_b"], 0.1, False),
    ]
    for run in r["accept"]:
        checks.append(
            check(
                f"accept rate at {run['connections']} connections >= A's publish rate",
                found[f"accept_{run['connections']}_vs_a_publish"],
                1.0,
                True,
            )
        )
    widest = max(r["accept"], key=lambda run: run["connections"])
    checks.append(
        check(
            f"0 errors at {widest['connections']} connections (503 allowed)",
            widest["errors"],
            0,
            False,
        )
    )
    streams = r["streams"]
    checks.append(
        check(
            f"{streams['streams']} SSE streams held",
            streams["held_to_the_end"],
            streams["streams"],
            True,
        )
    )
    checks.append(
        check(f"API RSS with them < {RSS_LIMIT_MB} MB", streams["rss_peak_mb"], RSS_LIMIT_MB, False)
    )
    if "model" in result:
        checks += model_targets(result["model"], a)
    if "remote" in result:
        checks += remote_targets(result["remote"])
    return checks


def noop_target(m: dict[str, Any], a: dict[str, Any] | None) -> dict[str, Any]:
    """The threads pool's noop figure against bare Celery prefork's made right before it in
    the same phase (``bench.model.noop_prefork``); a run from before that pair: against
    baseline A's, minutes earlier."""
    threads = m["noop_threads"]
    prefork = m.get("noop_prefork")
    name = "noop throughput, threads pool, one process >= 0.8x A (prefork"
    if prefork is None:
        prefork = (a or {}).get("throughput", {})
        name += ", at the run's start)"
    else:
        name += ", run right before it)"
    ratio = _ratio(threads["tasks_per_s"], prefork.get("tasks_per_s"))
    return check(name, ratio, 0.8, True, (threads, prefork))


def remote_targets(r: dict[str, Any]) -> list[dict[str, Any]]:
    bridge, direct = r["bridge"], r["direct"]
    paired = bridge.get("paired")
    runs: tuple[dict[str, Any], ...] = (bridge, direct)
    if paired is not None and "submit_ratio" in paired:
        name = (
            f"submit to final (first POST to last task final), median of"
            f" {len(paired['pairs'])} runs, each against a direct run right before it"
        )
        ratio = paired["submit_ratio"]
        runs = (direct, *(o for p in paired["pairs"] for o in p["outcomes"].values()))
    elif paired is not None:  # a run from before submit to final: the drain alone
        name = f"drain only, median of {len(paired['pairs'])} runs, each against a direct run"
        ratio = paired["ratio"]
    else:  # a run from before the pairs: against the phase's first direct run
        name, ratio = (
            "against the phase's direct run",
            _ratio(bridge["tasks_per_s"], direct["tasks_per_s"]),
        )
    held = bridge["held"]
    return [
        check(
            f"remote agent: throughput >= {REMOTE_THROUGHPUT_RATIO}x direct calls ({name})",
            ratio,
            REMOTE_THROUGHPUT_RATIO,
            True,
            runs,
        ),
        check(
            f"remote agent: added latency p50 <= {REMOTE_ADDED_P50_LIMIT_MS:.0f} ms",
            bridge["added_latency"]["p50_ms"],
            REMOTE_ADDED_P50_LIMIT_MS,
            False,
        ),
        check(
            f"remote agent: one bridge process holds {bridge['slots']} calls in flight",
            held["in_flight_max"],
            bridge["slots"],
            True,
            (held,),
        ),
    ]


def remote_table(result: dict[str, Any]) -> str:
    """The remote-agent phase: the agent called through the bridge, against calling it
    directly and against bare Celery's pools calling it (a run from before those were
    measured shows them as —)."""
    r = result["remote"]
    direct, bridge = r["direct"], r["bridge"]
    bare = [r.get("a_threads"), r.get("a_gevent")]
    pools = [f"A-{a['pool']} -c {a['slots']}" for a in bare if a is not None]
    bare = [a for a in bare if a is not None]
    header = ["figure", "unit", "direct (aiohttp)", *pools, f"bridge -c {bridge['slots']}"]
    lines = [[*header, "bridge / direct", "bridge / best A"]]

    def add(
        name: str,
        unit: str,
        of_direct: Any,
        of_bare: Any,
        of_bridge: Any,
        best_of: Callable[..., Any] | None,
    ) -> None:
        b = of_bridge
        found = [a for a in of_bare if a is not None]
        versus_direct = _ratio(b, of_direct) if best_of is not None else None
        versus_bare = _ratio(b, best_of(found)) if best_of is not None and found else None
        lines.append(
            [
                name,
                unit,
                _cell(of_direct),
                *(_cell(a) for a in of_bare),
                _cell(b),
                f"{versus_direct:.2f}x" if versus_direct is not None else "—",
                f"{versus_bare:.2f}x" if versus_bare is not None else "—",
            ]
        )

    figures: tuple[tuple[str, str, Callable[[dict[str, Any]], Any], Callable[..., Any]], ...] = (
        ("throughput (A, bridge: tasks queued first)", "calls/s", lambda s: s["tasks_per_s"], max),
        ("added latency p50", "ms", lambda s: s["added_latency"]["p50_ms"], min),
        ("added latency p99", "ms", lambda s: s["added_latency"]["p99_ms"], min),
        ("added latency p50, the agent answering at once", "ms", _instant_p50, min),
        ("calls in flight at most", "", lambda s: s["in_flight_max"], max),
    )
    for name, unit, value, best_of in figures:
        add(name, unit, value(direct), [value(a) for a in bare], value(bridge), best_of)
    held = bridge["held"]
    none = [None] * len(bare)
    add(
        f"calls held at once ({held['call_s']:.0f} s each)",
        "",
        None,
        none,
        held["in_flight_max"],
        None,
    )
    add("bridge RSS holding them", "MB", None, none, held["bridge_rss_peak_mb"], None)
    add(
        "worker RSS at the peak",
        "MB",
        None,
        [a.get("worker_rss_peak_mb") for a in bare],
        bridge["bridge_rss_peak_mb"],
        min,
    )
    # Every process's CPU per call, during the calls: what the cores have to give. A direct
    # call needs no Postgres or Redis; bare Celery needs Redis.
    cpu = (
        (
            "caller / worker",
            "caller_cpu_ms_per_task",
            "worker_cpu_ms_per_task",
            "bridge_cpu_ms_per_task",
        ),
        ("the agent", "agent_cpu_ms_per_task", "agent_cpu_ms_per_task", "agent_cpu_ms_per_task"),
        ("Postgres + Redis", None, "services_cpu_ms_per_task", "services_cpu_ms_per_task"),
    )
    whole: list[float | None] = [0.0] * (len(bare) + 2)  # None: a part was not measured
    for name, of_direct, of_bare, of_bridge in cpu:
        parts = [
            direct.get(of_direct) if of_direct else 0.0,
            *(a.get(of_bare) for a in bare),
            bridge.get(of_bridge),
        ]
        whole = [_plus(w, p) for w, p in zip(whole, parts, strict=True)]
        shown = [parts[0] or None, *parts[1:]]
        add(f"CPU per call: {name}", "ms", shown[0], shown[1:-1], shown[-1], min)
    add("CPU per call: all of them", "ms", whole[0], whole[1:-1], whole[-1], min)
    add_ceilings(add, direct, bare, bridge, r.get("cores"))
    paired = bridge.get("paired")
    submitted = bridge.get("submit_to_final")
    if submitted is not None:
        # The target's figure: through the API, first POST to last task final, the bridge
        # running and warm; the throughput row above is the bridge draining tasks queued
        # before it started, the API's intake left out.
        add(
            "throughput, submit to final (API included)",
            "calls/s",
            paired["pairs"][0]["direct"] if paired else direct["tasks_per_s"],
            none,
            submitted["tasks_per_s"],
            max,
        )
        add(
            "CPU per call, submit to final: every process (client, API, bridge, agent,"
            " Postgres + Redis)",
            "ms",
            None,
            none,
            submitted.get("all_cpu_ms_per_task"),
            None,
        )
    for i, pair in enumerate(paired["pairs"] if paired else [], start=1):
        add(
            f"throughput, run {i}: direct, then bridge (drain)",
            "calls/s",
            pair["direct"],
            none,
            pair["bridge"],
            max,
        )
        if "submit_to_final" in pair:
            add(
                f"throughput, run {i}: direct, then bridge (submit to final)",
                "calls/s",
                pair["direct"],
                none,
                pair["submit_to_final"],
                max,
            )
    medians = (("ratio", "drain"), ("submit_ratio", "submit to final"))
    for key, what in medians if paired else ():
        if key in paired:
            lines.append(
                [
                    f"bridge / direct, {what}, median of the {len(paired['pairs'])} runs",
                    "",
                    "",
                    *([""] * len(bare)),
                    "",
                    f"{paired[key]:.2f}x",
                    "—",
                ]
            )
    two = bridge.get("two_bridges")
    if two is not None:
        each = two["slots"] // two["bridges"]
        add(
            f"throughput, {two['bridges']} bridges -c {each} each (direct right before)",
            "calls/s",
            two.get("direct_tasks_per_s", direct["tasks_per_s"]),
            none,
            two["tasks_per_s"],
            max,
        )
        add(
            f"CPU per call: the {two['bridges']} bridges",
            "ms",
            None,
            none,
            two["bridge_cpu_ms_per_task"],
            None,
        )
    steady = bridge.get("steady")
    if steady is not None:
        add(
            f"throughput, {steady['calls']:,} calls (settled)",
            "calls/s",
            steady["direct"]["tasks_per_s"],
            none,
            steady["bridge"]["tasks_per_s"],
            max,
        )
    table = _markdown(lines)
    return table + ("\n\n" + remote_curve_table(r) if bridge.get("curve") else "")


def add_ceilings(
    add: Callable[..., None],
    direct: dict[str, Any],
    bare: list[dict[str, Any]],
    bridge: dict[str, Any],
    cores: int | None,
) -> None:
    """The most calls a second each way could make at the CPU a call it spent in the main run:
    its own process's core (1,000 ms over that process's CPU a call: the caller, the worker,
    the bridge), and the machine's cores (over every process's CPU a call together). A rate
    near a ceiling is bound by it."""
    own = ("caller_cpu_ms_per_task", "worker_cpu_ms_per_task", "bridge_cpu_ms_per_task")
    runs = [direct, *bare, bridge]
    keys = [own[0], *([own[1]] * len(bare)), own[2]]

    def most(cpu_ms: float | None, count: int) -> float | None:
        return round(count * 1000 / cpu_ms, 1) if cpu_ms else None

    processes = [most(run.get(key), 1) for run, key in zip(runs, keys, strict=True)]
    add(
        "most calls/s, the process's one core",
        "calls/s",
        processes[0],
        processes[1:-1],
        processes[-1],
        max,
    )
    if cores:
        every = [
            _plus(
                _plus(run.get(key), run.get("agent_cpu_ms_per_task")),
                run.get("services_cpu_ms_per_task", 0.0),
            )
            for run, key in zip(runs, keys, strict=True)
        ]
        machine = [most(cpu, cores) for cpu in every]
        add(
            f"most calls/s, the machine's {cores} cores",
            "calls/s",
            machine[0],
            machine[1:-1],
            machine[-1],
            max,
        )


def remote_curve_table(r: dict[str, Any]) -> str:
    """Throughput by calls at once: where one bridge process stops keeping up with the
    agent (its core), and bare Celery's best pool at each (— in a run without it)."""
    direct, bridge = r["direct"], r["bridge"]
    pools = [r[k] for k in ("a_threads", "a_gevent") if k in r]
    best = max(pools, key=lambda a: a["tasks_per_s"]) if pools else None
    main = {"slots": bridge["slots"], "direct": direct, "bridge": bridge, "bare": best}
    points = [*bridge["curve"], main]
    bare_title = f"A-{best['pool']} calls/s" if best is not None else "bare Celery calls/s"
    lines = [
        [
            "calls at once",
            "direct calls/s",
            bare_title,
            "one bridge calls/s",
            "bridge / direct",
            "bridge / A",
            "bridge CPU per call (ms)",
        ]
    ]
    for point in points:
        d, b = point["direct"]["tasks_per_s"], point["bridge"]["tasks_per_s"]
        a = (point.get("bare") or {}).get("tasks_per_s")
        versus_direct, versus_bare = _ratio(b, d), _ratio(b, a)
        lines.append(
            [
                _cell(point["slots"]),
                _cell(d),
                _cell(a),
                _cell(b),
                f"{versus_direct:.2f}x" if versus_direct is not None else "—",
                f"{versus_bare:.2f}x" if versus_bare is not None else "—",
                _cell(point["bridge"]["bridge_cpu_ms_per_task"]),
            ]
        )
    return _markdown(lines)


def _plus(total: float | None, part: float | None) -> float | None:
    return None if total is None or part is None else total + part


def model_targets(m: dict[str, Any], a: dict[str, Any] | None = None) -> list[dict[str, Any]]:
    """The model phase's targets, and the noop one it measures (``a``: baseline A, for a run
    from before the phase made its own prefork run)."""
    reach, threads, gevent = m["reach"], m["a_threads"], m["a_gevent"]
    best = max(threads["tasks_per_s"], gevent["tasks_per_s"])
    return [
        check(
            "model latency: throughput >= the best bare Celery pool's",
            _ratio(reach["tasks_per_s"], best),
            1.0,
            True,
            (reach, threads, gevent),
        ),
        check(
            f"model latency: added latency p50 <= {MODEL_ADDED_P50_LIMIT_MS:.0f} ms",
            reach["added_latency"]["p50_ms"],
            MODEL_ADDED_P50_LIMIT_MS,
            False,
        ),
        rss_target(reach),
        noop_target(m, a),
    ]


def rss_target(reach: dict[str, Any]) -> dict[str, Any]:
    """The worker's RSS with ``MODEL_RSS_IN_FLIGHT`` calls in flight: met only when the model
    saw that many held at once (the ``-c`` a worker is given is not calls made), and the RSS
    was read at all (no reading is no figure, not 0 MB)."""
    held, samples = reach.get("in_flight_max"), reach.get("worker_rss_samples")
    because = None
    if not samples:
        because = "the worker's RSS was never read"
    elif held is None or held < MODEL_RSS_IN_FLIGHT:
        because = f"the model held {held} calls at most, not {MODEL_RSS_IN_FLIGHT}"
    return check(
        f"model latency: worker RSS <= {MODEL_RSS_LIMIT_MB} MB with {MODEL_RSS_IN_FLIGHT}"
        f" in flight (the model held {held} at most; {samples} readings)",
        reach["worker_rss_peak_mb"],
        MODEL_RSS_LIMIT_MB,
        False,
        (reach,),
        because,
    )


def model_table(result: dict[str, Any]) -> str:
    """The model-latency phase: each system's figures, and Agent-Reach's against the best
    bare Celery pool's."""
    m = result["model"]
    systems = [m["a_threads"], m["a_gevent"], m["reach"]]
    header = [
        "figure",
        "unit",
        "the model alone",
        f"A-threads -c {m['a_threads']['slots']}",
        f"A-gevent -c {m['a_gevent']['slots']}",
        f"Agent-Reach async -c {m['reach']['slots']}",
        "Reach / best A",
    ]
    figures: list[tuple[str, str, Callable[[dict[str, Any]], Any], Callable[..., Any]]] = [
        ("throughput", "tasks/s", lambda s: s["tasks_per_s"], max),
        ("added latency p50", "ms", lambda s: s["added_latency"]["p50_ms"], min),
        ("added latency p99", "ms", lambda s: s["added_latency"]["p99_ms"], min),
        ("added latency p50, the model answering at once", "ms", _instant_p50, min),
        ("calls in flight at most, as the model saw them", "", _held, max),
        ("worker RSS at the peak", "MB", lambda s: s["worker_rss_peak_mb"], min),
        ("worker CPU per task", "ms", lambda s: s["worker_cpu_ms_per_task"], min),
        # The worker alone leaves out what a system moves to its other processes: Agent-Reach
        # its API, Postgres and Redis; bare Celery its publisher and Redis.
        (
            "CPU per task: every process (client, API, worker, model, Postgres + Redis)",
            "ms",
            lambda s: s.get("all_cpu_ms_per_task"),
            min,
        ),
    ]
    # The model answered straight, one call at a time: the part of each added latency that
    # is the model's own answer (runs from before 2026-12-03 have none).
    model_alone = m.get("model_alone", {})
    alone = model_alone.get("added_latency", {})
    floors = {
        "added latency p50": alone.get("p50_ms"),
        "added latency p99": alone.get("p99_ms"),
        "added latency p50, the model answering at once": _instant_p50(model_alone),
    }
    lines = [header]
    for name, unit, value, best_of in figures:
        a_threads, a_gevent, reach = (value(s) for s in systems)
        found = [a for a in (a_threads, a_gevent) if a is not None]
        ratio = _ratio(reach, best_of(found)) if found else None
        shown = f"{ratio:.2f}x" if ratio is not None else "—"
        row = [
            name,
            unit,
            _cell(floors.get(name)),
            _cell(a_threads),
            _cell(a_gevent),
            _cell(reach),
            shown,
        ]
        lines.append(row)
    noop = m["noop_threads"]["tasks_per_s"]
    prefork = m.get("noop_prefork", {}).get("tasks_per_s")
    at_start = result.get("baseline_a", {}).get("throughput", {}).get("tasks_per_s")
    # The target's prefork run is the one right before the threads pool's; baseline A's,
    # minutes earlier, beside it. The phase alone (``python -m bench.model``) has no
    # baseline A, and runs from before the pair have no run right before.
    noops = []
    if prefork is not None or at_start is None:
        noops.append(("noop throughput (A: prefork, run right before)", prefork))
    if at_start is not None:
        noops.append(("noop throughput (A: prefork, at the run's start)", at_start))
    for name, a_noop in noops:
        ratio = _ratio(noop, a_noop)
        lines.append(
            [
                name,
                "tasks/s",
                "—",
                _cell(a_noop),
                "—",
                _cell(noop),
                f"{ratio:.2f}x" if ratio is not None else "—",
            ]
        )
    return _markdown(lines)


def _held(figures: dict[str, Any]) -> int | None:
    """The most calls the model held at once (runs before 2026-12 have none)."""
    held: int | None = figures.get("in_flight_max")
    return held


def _instant_p50(figures: dict[str, Any]) -> float | None:
    """The p50 of the round trips made to a model or agent answering at once, made call by
    call between the waited ones (runs before 2026-12-03 23:00 UTC have none)."""
    instant: dict[str, float] = figures.get("added_latency_instant", {})
    return instant.get("p50_ms")


def _cell(value: float | str | None) -> str:
    if value is None:
        return "—"
    if isinstance(value, str):
        return value
    return f"{value:,.0f}" if abs(value) >= 100 else f"{value:,.3g}"


def table(result: dict[str, Any]) -> str:
    header = ["figure", "unit", "A: Celery+Redis", "B: Celery+DB", "Agent-Reach", "Reach / A"]
    lines = [header]
    for row in rows(result):
        ratio = f"{row.vs_a:.2f}x" if row.vs_a is not None else "—"
        lines.append([row.figure, row.unit, _cell(row.a), _cell(row.b), _cell(row.reach), ratio])
    return _markdown(lines)


def _markdown(lines: list[list[str]]) -> str:
    header = lines[0]
    widths = [max(len(line[i]) for line in lines) for i in range(len(header))]
    out = []
    for n, line in enumerate(lines):
        cells = [
            cell.ljust(width) if i < 2 else cell.rjust(width)
            for i, (cell, width) in enumerate(zip(line, widths, strict=True))
        ]
        out.append("| " + " | ".join(cells) + " |")
        if n == 0:
            out.append(
                "|"
                + "|".join(
                    "-" * (w + 2) if i < 2 else "-" * (w + 1) + ":" for i, w in enumerate(widths)
                )
                + "|"
            )
    return "\n".join(out)


def target_lines(result: dict[str, Any]) -> str:
    out = []
    for found in result["targets"]:
        mark = "met   " if found["met"] else "MISSED"
        line = f"  {mark}  {found['target']}: {found['value']} (limit {found['limit']})"
        out.append(line + (f"; not met: {found['because']}" if found.get("because") else ""))
    return "\n".join(out)


def foreign_lines(result: dict[str, Any]) -> str:
    """Others' CPU per phase, several to a line: a figure taken on a busy machine says so."""
    cells = [f"{name} {cores:.2f}" for name, cores in result["foreign_cores"].items()]
    return "\n".join("  " + ", ".join(cells[i : i + 4]) for i in range(0, len(cells), 4))
