"""The interpreter settings of ``broker.runtime`` in real processes: the API that serves, and
the workers' processes, prefork children and threads pool alike; the loop async handlers run
on."""

from __future__ import annotations

import gc
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from api.app import create_app
from broker.settings import Settings
from tests.integration.conftest import client_for
from tests.integration.stack import ServedApp, start_worker

THRESHOLD = 4321  # neither Python's 700 nor our default


@pytest.fixture
def collector_restored() -> Iterator[None]:
    before = gc.get_threshold()
    yield
    gc.set_threshold(*before)


@pytest.mark.usefixtures("collector_restored")
def test_the_api_process_sets_its_collector_when_it_starts_serving(settings: Settings) -> None:
    gc.set_threshold(700, 10, 10)
    with ServedApp(create_app(settings.model_copy(update={"gc_gen0_threshold": THRESHOLD}))) as api:
        assert httpx.get(f"{api.url}/healthz", timeout=10).status_code == 200
        assert gc.get_threshold() == (THRESHOLD, 10, 10)


@pytest.mark.parametrize("pool", ["prefork", "threads"])
def test_a_workers_handlers_run_with_its_collector_set(
    pool: str,
    settings: Settings,
    log_dir: Path,
    api: ServedApp,
    make_key,  # type: ignore[no-untyped-def]
) -> None:
    tuned = settings.model_copy(update={"gc_gen0_threshold": THRESHOLD})
    worker = start_worker(tuned, "test.runtime", f"runtime-{pool}", log_dir, pool=pool)
    try:
        result = sync_result(api, make_key()[1], "test.runtime")
        assert result["gc_threshold"][0] == THRESHOLD
        if pool == "prefork":  # a child forked after the main process set it
            assert result["pid"] != worker.pid
        else:
            assert result["pid"] == worker.pid
    finally:
        worker.stop()


@pytest.mark.parametrize(
    ("pool", "event_loop", "expected"),
    [
        ("threads", "uvloop", "uvloop.Loop"),
        ("prefork", "uvloop", "uvloop.Loop"),
        ("threads", "asyncio", "asyncio.unix_events._UnixSelectorEventLoop"),
    ],
)
def test_async_handlers_run_on_the_loop_the_settings_name(
    pool: str,
    event_loop: str,
    expected: str,
    settings: Settings,
    log_dir: Path,
    api: ServedApp,
    make_key,  # type: ignore[no-untyped-def]
) -> None:
    chosen = settings.model_copy(update={"event_loop": event_loop})
    name = f"runtime-loop-{pool}-{event_loop}"
    worker = start_worker(chosen, "test.runtime-loop", name, log_dir, pool=pool)
    try:
        assert sync_result(api, make_key()[1], "test.runtime-loop")["loop"] == expected
    finally:
        worker.stop()


def sync_result(api: ServedApp, key: str, capability: str) -> Any:
    """The result of one sync call of ``capability``."""
    with client_for(api, key) as http:
        answer = http.post(
            "/tasks", json={"capability": capability, "payload": {}, "reply_mode": "sync"}
        )
    assert answer.status_code == 200, answer.text
    return answer.json()["result"]
