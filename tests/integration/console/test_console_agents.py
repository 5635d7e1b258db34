"""The console's agents page, in Chromium: an instance's state follows its worker's life."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from playwright.sync_api import Locator, expect
from sqlalchemy import Engine

from broker.settings import Settings
from broker.tenancy import key_store
from tests.integration.console.conftest import Console
from tests.integration.stack import CeleryProcess, start_worker


@pytest.fixture
def shown_instance(
    console: Console, engine: Engine, settings: Settings, log_dir: Path
) -> Iterator[tuple[CeleryProcess, Locator, str]]:
    """A worker of its own for test.pool, and its row on the agents page, shown ready to an
    operator (instances are shown by name to operators only): (worker, row, its name)."""
    _, key = key_store.create_key(engine, "console-ops", ["*"], is_admin=True)
    name = f"console-{time.monotonic_ns() % 10**9}"
    worker = start_worker(settings, "test.pool", name, log_dir, concurrency=1)
    try:
        console.sign_in(key)
        console.page.get_by_role("link", name="Agents").click()
        row = console.page.locator(
            f"article[data-agent-id='test-pool'] tr[data-instance^='{name}@']"
        )
        expect(row.locator(".badge")).to_have_text("ready")
        yield worker, row, name
    finally:
        worker.stop()


def test_an_agent_goes_offline_on_its_page_when_its_worker_is_killed(
    console: Console, shown_instance: tuple[CeleryProcess, Locator, str]
) -> None:
    doomed, row, _ = shown_instance
    expect(row.get_by_role("button", name="Drain")).to_be_visible()
    # When its worker dies without a word, the page shows it offline on its own
    doomed.kill_hard()
    expect(row.locator(".badge")).to_have_text("offline", timeout=30_000)
    expect(row.get_by_role("button", name="Drain")).to_have_count(0)
    assert console.errors == []


def test_an_operator_drains_an_instance_from_the_agents_page(
    console: Console, shown_instance: tuple[CeleryProcess, Locator, str]
) -> None:
    _, row, name = shown_instance
    row.get_by_role("button", name="Drain").click()
    expect(console.page.get_by_role("status")).to_contain_text(f"Drain requested for {name}@")
    # Holding nothing, it stops taking work and goes offline: the page follows
    expect(row.locator(".badge")).to_have_text("offline", timeout=30_000)
    assert console.errors == []
