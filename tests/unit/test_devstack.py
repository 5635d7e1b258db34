"""The processes ``reach dev`` starts, read from the commands it builds (nothing is run)."""

from __future__ import annotations

from pathlib import Path

import workers.examples  # noqa: F401  # registers the example agents
from broker.settings import Settings
from broker.tasks.dispatch import MAINTENANCE_QUEUE, WEBHOOKS_QUEUE
from reach import devstack
from workers.sdk import agent

MODEL_URL = "http://127.0.0.1:8701"


def _queues(argv: list[str]) -> set[str]:
    return set(argv[argv.index("-Q") + 1].split(",")) if "-Q" in argv else set()


def test_maintenance_and_webhooks_each_have_a_worker_of_their_own(tmp_path: Path) -> None:
    # given the dev stack's commands
    commands = devstack._commands(8000, 5555, tmp_path, MODEL_URL)
    # when the queues of each worker are read
    workers = {name: _queues(argv) for name, argv in commands.items() if "worker" in argv}
    # expect the maintenance queue and the webhooks queue each alone in a worker, so slow
    # receivers never hold up the reaper, sweepers or janitor, nor agents hold up either
    alone = [queues for queues in workers.values() if len(queues) == 1]
    assert {MAINTENANCE_QUEUE} in alone and {WEBHOOKS_QUEUE} in alone, workers
    for queues in workers.values():
        if queues & {MAINTENANCE_QUEUE, WEBHOOKS_QUEUE}:
            assert len(queues) == 1, workers
    # and Flower on this machine only
    assert "--address=127.0.0.1" in commands["flower"]


def test_the_webhooks_worker_has_more_processes_than_one_tenant_may_hold(tmp_path: Path) -> None:
    # given the dev stack's webhooks worker and the default per-tenant bound
    [argv] = [
        a
        for a in devstack._commands(8000, 5555, tmp_path, MODEL_URL).values()
        if "-Q" in a and _queues(a) == {WEBHOOKS_QUEUE}
    ]
    bound = Settings.model_fields["webhook_max_inflight_per_tenant"].default
    # expect room for other tenants when one holds all it may
    assert int(argv[argv.index("-c") + 1]) > bound


def test_every_example_capability_has_a_worker_and_async_ones_run_on_the_threads_pool(
    tmp_path: Path,
) -> None:
    # given the dev stack's commands and the capabilities the examples declare
    commands = devstack._commands(8000, 5555, tmp_path, MODEL_URL)
    served = set().union(*(_queues(argv) for argv in commands.values()))
    declared = {s.name for s in agent if s.handler.__module__.startswith("workers.examples.")}
    # expect each one consumed, and llm.complete by a threads worker beside its model
    assert declared <= served, declared - served
    [async_worker] = [a for a in commands.values() if "llm.complete" in _queues(a)]
    assert async_worker[async_worker.index("-P") + 1] == "threads"
    assert "--port=8701" in commands["model"]


def test_the_dev_stack_runs_the_bridge_for_remote_agents(tmp_path: Path) -> None:
    # given the dev stack's commands
    bridge = devstack._commands(8000, 5555, tmp_path, MODEL_URL)["bridge"]
    # expect the bridge's app on the threads pool, with no queue of its own named
    assert bridge[bridge.index("-A") + 1] == "workers.bridge"
    assert bridge[bridge.index("-P") + 1] == "threads"
    assert "-Q" not in bridge
