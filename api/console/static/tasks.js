// Tasks: filtered by capability, status and session, a page at a time, statuses refreshed live.

import { FINAL, get, query } from "./api.js";
import { badge, h, when } from "./dom.js";
import { pager, poll } from "./live.js";

const STATUSES = ["queued", "running", ...FINAL];
const REFRESH_MS = 2000;

export function renderTasks(main, params) {
  const filters = {
    capability: params.get("capability") ?? "",
    status: params.get("status") ?? "",
    session_id: params.get("session_id") ?? "",
  };
  const body = h("tbody");
  const problem = h("div", { "aria-live": "polite" });
  const pages = pager(() => live.refresh());

  const capability = h("input", {
    id: "filter-capability",
    name: "capability",
    list: "known-capabilities",
    value: filters.capability,
    placeholder: "any",
  });
  const known = h("datalist", { id: "known-capabilities" });
  const status = h(
    "select",
    { id: "filter-status", name: "status" },
    h("option", { value: "" }, "any"),
    STATUSES.map((s) => h("option", { value: s, selected: s === filters.status }, s)),
  );
  const session = h("input", {
    id: "filter-session",
    name: "session_id",
    value: filters.session_id,
    placeholder: "any",
    spellcheck: "false",
  });
  const form = h(
    "form",
    { class: "filters", onsubmit: applyFilters },
    h("div", {}, h("label", { for: "filter-capability" }, "Capability"), capability, known),
    h("div", {}, h("label", { for: "filter-status" }, "Status"), status),
    h("div", {}, h("label", { for: "filter-session" }, "Session"), session),
    h("button", { type: "submit" }, "Filter"),
  );
  main.append(
    h("h1", {}, "Tasks"),
    filters.session_id
      ? h(
          "p",
          {},
          "Of the session ",
          h("a", { href: `#/sessions${query({ id: filters.session_id })}`, class: "mono" }, filters.session_id),
        )
      : "",
    form,
    problem,
    h(
      "div",
      { class: "scroll" },
      h(
        "table",
        { class: "tasks" },
        h(
          "thead",
          {},
          h(
            "tr",
            {},
            ["Task", "Capability", "Status", "Progress", "Created", "Finished"].map((t) =>
              h("th", { scope: "col" }, t),
            ),
          ),
        ),
        body,
      ),
    ),
    pages.nav,
  );

  function applyFilters(event) {
    event.preventDefault();
    const wanted = {
      capability: capability.value.trim(),
      status: status.value,
      session_id: session.value.trim(),
    };
    window.location.hash = `#/tasks${query(wanted)}`;
  }

  function show(tasks) {
    const rows = new Map([...body.rows].map((row) => [row.dataset.taskId, row]));
    const same = tasks.length > 0 && tasks.length === rows.size && tasks.every((t) => rows.has(t.task_id));
    if (!same) {
      body.replaceChildren(...tasks.map(row));
      if (!tasks.length) body.append(h("tr", {}, h("td", { colspan: 6 }, "No tasks.")));
      return;
    }
    for (const task of tasks) {
      const current = rows.get(task.task_id);
      if (current.dataset.version !== version(task)) current.replaceWith(row(task));
    }
  }

  get("capabilities")
    .then((found) => {
      known.replaceChildren(...found.capabilities.map((c) => h("option", { value: c.capability })));
    })
    .catch(() => {});
  const live = poll({
    every: REFRESH_MS,
    read: () => get(`tasks${query({ ...filters, limit: 20, cursor: pages.cursor() })}`),
    show: (found) => {
      pages.shown(found.next_cursor);
      show(found.tasks);
    },
    problem,
  });
  return live.stop;
}

function version(task) {
  return `${task.status}|${task.progress?.percent ?? ""}|${task.finished_at ?? ""}`;
}

function row(task) {
  const percent = task.progress?.percent;
  return h(
    "tr",
    { "data-task-id": task.task_id, "data-version": version(task) },
    h("td", {}, h("a", { href: `#/tasks/${task.task_id}`, class: "mono" }, task.task_id)),
    h("td", {}, task.capability),
    h("td", {}, badge(task.status)),
    h("td", {}, percent === undefined ? "—" : `${percent}%`),
    h("td", {}, when(task.created_at)),
    h("td", {}, when(task.finished_at)),
  );
}
