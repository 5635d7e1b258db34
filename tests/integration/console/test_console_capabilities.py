"""The console's capabilities page, in Chromium: a capability's last hour as a chart."""

from __future__ import annotations

import re

from playwright.sync_api import expect

from tests.integration.conftest import client_for
from tests.integration.console.conftest import NARROW, Console
from tests.integration.console.test_screenshots import fits
from tests.integration.stack import ServedApp, wait_for_task

FINAL = {"succeeded", "failed", "cancelled", "expired"}


def test_a_capability_that_ran_tasks_has_a_chart_that_says_what_it_shows(
    console: Console, key: str, api: ServedApp
) -> None:
    # Given a fresh tenant whose echo tasks ran: three succeeded, one failed
    with client_for(api, key) as http:
        payloads = [{"i": 1}, {"i": 2}, {"i": 3}, {"fail": "out_of_paper"}]
        for payload in payloads:
            task = http.post("/tasks", json={"capability": "echo", "payload": payload}).json()
            wait_for_task(http, task["task_id"], FINAL)

    # When it opens the capabilities page
    console.sign_in(key)
    console.page.get_by_role("link", name="Capabilities").click()

    # Then echo has a chart whose accessible name tells the hour in words
    figure = console.page.locator("figure.chart[data-capability='echo']")
    chart = figure.get_by_role("img")
    expect(chart).to_have_accessible_name(
        re.compile(r"^echo, the last 60 minutes: 4 tasks \(3 succeeded, 1 failed\), .*p95 \d+")
    )
    # ... bars for both outcomes, lines for the run times, and the time axis labelled
    expect(figure.locator("rect.failed")).to_have_count(1)
    expect(figure.locator("rect.ok").first).to_be_visible()
    expect(figure.locator("circle.p50_run_s").first).to_be_attached()
    expect(figure.locator("svg text").last).to_have_text(re.compile(r"\d:\d\d.* now$"))
    # ... while a capability it never ran has no chart, only a mention
    expect(console.page.locator("figure.chart")).to_have_count(1)
    idle = console.page.get_by_text(re.compile("No tasks in the last hour: .*invoice"))
    expect(idle).to_be_visible()
    # ... and the page still reads at 390 px
    console.page.set_viewport_size(NARROW)
    expect(chart).to_be_visible()
    assert fits(console.page)
    assert console.errors == []


# Counts the page's requests of the table and of the series.
COUNT_READS = """
window.__reads = { table: 0, series: 0 };
const fetched = window.fetch;
window.fetch = (url, init) => {
  const path = new URL(url, location.href).pathname;
  if (path.endsWith("/capabilities")) window.__reads.table += 1;
  if (path.endsWith("/series")) window.__reads.series += 1;
  return fetched(url, init);
};
"""


def test_the_charts_are_read_once_a_minute_not_with_every_refresh_of_the_table(
    console: Console, key: str
) -> None:
    """A series takes a task token from the bucket POST /tasks takes from: read with the table
    every 5 s, one per capability, they left the tenant's own submits a 429."""
    page = console.page
    page.add_init_script(COUNT_READS)
    page.clock.install()
    console.sign_in(key)
    expect(page.get_by_role("heading", name="Tasks")).to_be_visible()  # signed in
    console.open("#/capabilities")
    expect(page.get_by_text(re.compile("No tasks in the last hour: .*echo"))).to_be_visible()
    first = page.evaluate("window.__reads")
    assert first["series"] > 1  # one for each capability this key is shown

    def reads_reach(kind: str, count: int) -> None:
        page.wait_for_function("([k, n]) => window.__reads[k] >= n", arg=[kind, count])

    # Refreshes of the table later (15 s on the page's clock), no chart was read again
    page.clock.run_for(15_500)
    reads_reach("table", first["table"] + 1)
    assert page.evaluate("window.__reads.series") == first["series"]
    # A minute on, the charts are read again; and at once when asked
    page.clock.run_for(60_000)
    reads_reach("series", 2 * first["series"])
    page.get_by_role("button", name="Refresh charts").click()
    reads_reach("series", 3 * first["series"])
    assert console.errors == []
