// Capabilities: live instances, queue depth (operator keys), success rate and run times every
// few seconds, and each one's last hour in a chart (chart.js) once a minute or when asked. A
// series is real work for the API (a task token, from the bucket POST /tasks takes from too):
// read with the list every 5 s, one per capability, they left the tenant's submits a 429.

import { get, pathPart } from "./api.js";
import { duration, seriesChart } from "./chart.js";
import { alertBox, h } from "./dom.js";
import { poll } from "./live.js";

const REFRESH_MS = 5000;
const CHARTS_MS = 60_000;

export function renderCapabilities(main) {
  const body = h("tbody");
  const problem = h("div", { "aria-live": "polite" });
  const windowNote = h("p", { class: "muted" });
  const charts = h("div", { class: "charts" });
  const idle = h("p", { class: "muted" });
  const chartsProblem = h("div", { "aria-live": "polite" });
  main.append(
    h("h1", {}, "Capabilities"),
    windowNote,
    problem,
    h("div", { class: "scroll" }, h("table", { class: "capabilities" },
      h("thead", {}, h("tr", {}, ["Capability", "Served by", "Live instances", "Queue depth",
        "Tasks", "Success rate", "p50 run", "p95 run", ""].map((t) => h("th", { scope: "col" }, t)))),
      body)),
    h("h2", {}, "The last hour"),
    h("p", { class: "muted" }, "Your tenant's tasks finished per minute, and their run times, read once a minute. ",
      h("button", { type: "button", class: "small", onclick: () => hour.refresh() }, "Refresh charts")),
    chartsProblem,
    charts,
    idle,
  );

  const live = poll({
    every: REFRESH_MS,
    read: () => get("capabilities"),
    show: ({ capabilities }) => {
      const first = capabilities[0];
      windowNote.textContent = first
        ? `Figures from your tenant's tasks of the last ${Math.round(first.window_s / 60)} minutes.`
        : "No capability is served yet.";
      body.replaceChildren(...capabilities.map(row));
    },
    problem,
  });
  const hour = poll({
    every: CHARTS_MS,
    read: async () => {
      const found = await get("capabilities");
      // A chart for each capability that finished tasks in the hour; the others in one line.
      return Promise.allSettled(found.capabilities.map((c) => get(
        `capabilities/${pathPart(c.capability)}/series`)));
    },
    show: (series) => {
      const quiet = series.filter((s) => s.status === "fulfilled" && !s.value.total.tasks);
      charts.replaceChildren(...series.filter((s) => !quiet.includes(s)).map((s) => (
        s.status === "fulfilled" ? seriesChart(s.value) : alertBox(s.reason))));
      idle.textContent = quiet.length
        ? `No tasks in the last hour: ${quiet.map((s) => s.value.capability).join(", ")}.`
        : "";
    },
    problem: chartsProblem,
  });
  return () => {
    live.stop();
    hour.stop();
  };
}

function row(c) {
  const m = c.measured ?? {};
  const name = encodeURIComponent(c.capability);
  return h("tr", { "data-capability": c.capability },
    h("th", { scope: "row" }, c.capability),
    h("td", {}, c.cards.map((card) => `${card.agent_id}@${card.version}`).join(", ")),
    h("td", { class: c.live_instances ? "" : "warn" }, String(c.live_instances)),
    h("td", {}, c.queue_depth === undefined ? "—" : String(c.queue_depth)),
    h("td", {}, String(m.tasks ?? 0)),
    h("td", {}, m.success_rate === null || m.success_rate === undefined ? "—" : `${(100 * m.success_rate).toFixed(1)}%`),
    h("td", {}, duration(m.p50_run_s)),
    h("td", {}, duration(m.p95_run_s)),
    h("td", {}, h("a", { href: `#/tasks?capability=${name}` }, "Tasks"), " ",
      h("a", { href: `#/submit?capability=${name}` }, "Submit")),
  );
}
