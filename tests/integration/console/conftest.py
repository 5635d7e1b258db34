"""The console in a real browser: Playwright driving Debian's Chromium, headless, against the
running stack (uvicorn API, Celery worker, Postgres, Redis). One browser for this package's
tests, a fresh context (so a fresh ``sessionStorage``) per test.

Playwright's sync API keeps an event loop marked running on the main thread for as long as it
is started, and ``asyncio.run`` refuses to run beside it: so it lives for this package only,
and every later test finds the main thread free again."""

from __future__ import annotations

import importlib.util
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest
from playwright.sync_api import (
    Browser,
    ConsoleMessage,
    Page,
    Playwright,
    expect,
    sync_playwright,
)

from tests.conftest import IN_CI
from tests.integration.conftest import KeyMaker
from tests.integration.stack import ROOT, CeleryProcess, ServedApp

WIDE = {"width": 1280, "height": 900}
NARROW = {"width": 390, "height": 844}


def _chromium() -> Path:
    spec = importlib.util.spec_from_file_location("chromium", ROOT / "scripts" / "chromium.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    path, why = module.ensure_chromium()
    if path is None:
        if IN_CI:
            pytest.fail(f"the console's browser tests must run in CI: {why}")
        pytest.skip(f"NO BROWSER, the console's browser tests are skipped: {why}")
    return Path(path)


@pytest.fixture(scope="package")
def playwright() -> Iterator[Playwright]:
    with sync_playwright() as found:
        yield found


@pytest.fixture(scope="package")
def browser(playwright: Playwright) -> Iterator[Browser]:
    launched = playwright.chromium.launch(executable_path=str(_chromium()), headless=True)
    yield launched
    launched.close()


@dataclass
class Console:
    """A page on the console, and every error its browser reported."""

    page: Page
    url: str
    errors: list[str] = field(default_factory=list)

    def open(self, fragment: str = "") -> None:
        self.page.goto(f"{self.url}/console{fragment}")

    def sign_in(self, key: str) -> None:
        self.open()
        self.page.get_by_label("API key").fill(key)
        self.page.get_by_role("button", name="Sign in").click()


@pytest.fixture
def console(browser: Browser, api: ServedApp, worker: CeleryProcess) -> Iterator[Console]:
    context = browser.new_context(viewport=WIDE)
    context.set_default_timeout(20_000)
    # The assertions wait as long as the actions: expect's own 5 s was not enough for a
    # Chromium on a loaded machine (a page's list shown after 5 s failed the test)
    expect.set_options(timeout=20_000)
    page = context.new_page()
    found = Console(page, api.url)

    def on_console(message: ConsoleMessage) -> None:
        if message.type == "error":
            found.errors.append(f"console: {message.text}")

    page.on("console", on_console)
    page.on("pageerror", lambda error: found.errors.append(f"pageerror: {error}"))
    yield found
    context.close()


@pytest.fixture
def key(make_key: KeyMaker) -> str:
    """A key of a fresh tenant, allowed every capability."""
    return make_key()[1]


def unreachable_agent(capabilities: list[str]) -> dict[str, object]:
    """A remote agent's registration (PUT /agents/{id}) at an address nothing answers (port
    9), for pages that list agents and capabilities."""
    return {
        "version": "1.0.0",
        "endpoint": {"protocol": "http", "url": "http://127.0.0.1:9/run"},
        "capabilities": [{"capability": c, "timeout_s": 5} for c in capabilities],
    }
