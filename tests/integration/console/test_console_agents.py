"""The console's agents page, in Chromium: an instance's state follows its worker's life."""

from __future__ import annotations

import secrets
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from playwright.sync_api import Locator, expect
from sqlalchemy import Engine

from broker.settings import Settings
from broker.tenancy import key_store
from tests.integration.conftest import client_for
from tests.integration.console.conftest import Console, unreachable_agent
from tests.integration.stack import CeleryProcess, ServedApp, start_worker


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


def test_an_operator_sets_and_removes_a_channel_and_revokes_a_version(
    console: Console, engine: Engine, api: ServedApp
) -> None:
    _, key = key_store.create_key(engine, "console-ops", ["*"], is_admin=True)
    agent_id = f"console-remote-{secrets.token_hex(3)}"
    registration = unreachable_agent([f"test.{agent_id}"])
    page = console.page
    with client_for(api, key) as ops:
        assert ops.put(f"/agents/{agent_id}", json=registration).status_code == 201
        try:
            console.sign_in(key)
            page.get_by_role("link", name="Agents").click()
            shown = page.locator(f"article[data-agent-id='{agent_id}']")
            expect(shown).to_be_visible()
            # When a canary channel is set from the form
            page.get_by_label("Agent").fill(agent_id)
            page.get_by_label("Channel").fill("canary")
            page.get_by_label("Weights").fill("1.0.0=100")
            page.get_by_role("button", name="Set channel").click()
            expect(shown.locator("[data-channel='canary']")).to_contain_text("1.0.0: 100")
            assert ops.get(f"/agents/{agent_id}").json()["channels"]["canary"]["versions"] == {
                "1.0.0": 100
            }
            # And removed again
            page.get_by_role("button", name=f"Remove the channel canary of {agent_id}").click()
            expect(shown.locator("[data-channel]")).to_have_count(0)
            assert ops.get(f"/agents/{agent_id}").json()["channels"] == {}
            # And its version revoked, after a confirmation
            page.once("dialog", lambda dialog: dialog.accept())
            page.get_by_role("button", name=f"Revoke {agent_id}@1.0.0").click()
            expect(shown.locator("[data-version='1.0.0'] .badge")).to_have_text("revoked")
            versions = ops.get(f"/agents/{agent_id}").json()["versions"]
            assert [(v["version"], v["lifecycle"]) for v in versions] == [("1.0.0", "revoked")]
        finally:
            ops.delete(f"/agents/{agent_id}")
    assert console.errors == []


def test_a_tenant_key_is_refused_the_operators_actions_with_the_reason(
    console: Console, key: str
) -> None:
    page = console.page
    console.sign_in(key)
    page.get_by_role("link", name="Agents").click()
    page.get_by_label("Agent").fill("echo")
    page.get_by_label("Channel").fill("canary")
    page.get_by_label("Weights").fill("1.0.0=1")
    page.get_by_role("button", name="Set channel").click()
    expect(page.get_by_role("alert")).to_contain_text("needs an admin key (admin_required)")
    assert [e for e in console.errors if "status of 403" not in e] == []
