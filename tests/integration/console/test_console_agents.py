"""The console's agents page, in Chromium: an instance's state follows its worker's life."""

from __future__ import annotations

import time
from pathlib import Path

from playwright.sync_api import expect
from sqlalchemy import Engine

from broker.settings import Settings
from broker.tenancy import key_store
from tests.integration.console.conftest import Console
from tests.integration.stack import start_worker


def test_an_agent_goes_offline_on_its_page_when_its_worker_is_killed(
    console: Console, engine: Engine, settings: Settings, log_dir: Path
) -> None:
    # An operator's key: instances are shown by name to operators only.
    _, key = key_store.create_key(engine, "console-ops", ["*"], is_admin=True)
    name = f"console-doomed-{time.monotonic_ns() % 10**6}"
    doomed = start_worker(settings, "test.pool", name, log_dir, concurrency=1)
    try:
        console.sign_in(key)
        console.page.get_by_role("link", name="Agents").click()
        row = console.page.locator(
            f"article[data-agent-id='test-pool'] tr[data-instance^='{name}@']"
        )
        expect(row.locator(".badge")).to_have_text("ready")
        expect(row.get_by_role("button", name="Drain")).to_be_visible()

        # When its worker dies without a word, the page shows it offline on its own
        doomed.kill_hard()
        expect(row.locator(".badge")).to_have_text("offline", timeout=30_000)
        expect(row.get_by_role("button", name="Drain")).to_have_count(0)
    finally:
        doomed.stop()
    assert console.errors == []


def test_an_operator_drains_an_instance_from_the_agents_page(
    console: Console, engine: Engine, settings: Settings, log_dir: Path
) -> None:
    _, key = key_store.create_key(engine, "console-ops", ["*"], is_admin=True)
    name = f"console-drained-{time.monotonic_ns() % 10**6}"
    drained = start_worker(settings, "test.pool", name, log_dir, concurrency=1)
    try:
        console.sign_in(key)
        console.page.get_by_role("link", name="Agents").click()
        row = console.page.locator(
            f"article[data-agent-id='test-pool'] tr[data-instance^='{name}@']"
        )
        expect(row.locator(".badge")).to_have_text("ready")

        row.get_by_role("button", name="Drain").click()
        expect(console.page.get_by_role("status")).to_contain_text(f"Drain requested for {name}@")
        # Holding nothing, it stops taking work and goes offline: the page follows
        expect(row.locator(".badge")).to_have_text("offline", timeout=30_000)
    finally:
        drained.stop()
    assert console.errors == []
