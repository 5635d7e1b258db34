// One task: its fields, payload and result, and its events as they happen (SSE).

import { FINAL, events, get, post } from "./api.js";
import { alertBox, badge, collapsible, definitionList, h, pretty, when } from "./dom.js";
import { act, poll } from "./live.js";
import { delivery } from "./webhooks.js";

const RECONNECT_MS = 1000;
const DELIVERIES_MS = 3000;

export function renderTask(main, taskId) {
  const stop = new AbortController();
  const title = h("h1", {}, "Task");
  const actions = h("div", { class: "actions" });
  const problem = h("div", { "aria-live": "polite" });
  const bar = h("progress", { id: "task-progress", max: 100, value: 0 });
  const barLabel = h("span", { id: "task-progress-label" }, "no progress reported");
  const fields = h("section", { "aria-label": "Envelope" });
  const failure = h("section", { "aria-label": "Error" });
  const payload = h("section", { class: "payload" });
  const result = h("section", { class: "result" });
  const outputs = h("ol", { id: "outputs", class: "outputs" });
  const timeline = h("ol", { id: "timeline", class: "timeline" });
  const live = h("span", { id: "stream-state", class: "muted" }, "connecting…");
  const deliveries = h("div", { id: "deliveries", class: "deliveries" });
  const deliveryStatus = h("div", { "aria-live": "polite" });
  let task = null;

  main.append(
    h("p", {}, h("a", { href: "#/tasks" }, "← Tasks")),
    title,
    actions,
    problem,
    h("div", { class: "progress" }, h("label", { for: "task-progress" }, "Progress"), bar, barLabel),
    h("div", { class: "columns" }, h("div", {}, fields, failure, payload, result,
      h("section", {}, h("h2", {}, "Deliveries"), deliveryStatus, deliveries)),
      h("div", {},
        h("section", {}, h("h2", {}, "Outputs"), outputs),
        h("section", {}, h("h2", {}, "Timeline ", live), timeline))),
  );

  function show(found) {
    task = { ...task, ...found };
    title.replaceChildren(`${task.capability} `, badge(task.status));
    fields.replaceChildren(
      h("h2", {}, "Envelope"),
      definitionList([
        ["Task id", h("span", { class: "mono" }, task.task_id)],
        ["Capability", task.capability],
        ["Status", badge(task.status)],
        ["Attempts", String(task.attempts)],
        ["Agent", task.agent ? `${task.agent.agent_id}@${task.agent.version ?? "?"}` : null],
        ["Instance", task.agent?.instance],
        ["Trace id", h("span", { class: "mono" }, task.trace_id)],
        ["Session", task.session_id],
        ["Created", when(task.created_at)],
        ["Started", when(task.started_at)],
        ["Finished", when(task.finished_at)],
        ["Expires", when(task.expires_at)],
      ]),
      Object.keys(task.metadata ?? {}).length ? collapsible("Metadata", task.metadata, false) : "",
    );
    failure.replaceChildren(
      task.error ? h("div", { class: "error", id: "task-error" },
        h("h2", {}, "Error"),
        definitionList([
          ["Code", task.error.code],
          ["Message", task.error.message],
          ["Retryable", String(task.error.retryable)],
        ])) : "",
    );
    if ("payload" in found && !payload.childElementCount) {
      payload.append(collapsible("Payload", found.payload));
    }
    if (FINAL.includes(task.status) && !result.childElementCount && task.status === "succeeded") {
      result.append(h("details", { open: true, id: "task-result" },
        h("summary", {}, "Result"), pretty(task.result)));
    }
    if (task.progress) showProgress(task.progress);
    else if (task.status === "succeeded") showProgress({ percent: 100, message: "done" });
    showActions();
  }

  function showProgress(progress) {
    bar.value = Math.max(0, Math.min(100, Number(progress.percent) || 0));
    barLabel.textContent = `${progress.percent}%${progress.message ? ` — ${progress.message}` : ""}`;
  }

  function showActions() {
    const buttons = [];
    if (!FINAL.includes(task.status)) {
      buttons.push(h("button", { type: "button", class: "danger", onclick: cancel }, "Cancel"));
    }
    if ("payload" in task) {
      buttons.push(h("button", { type: "button", onclick: resubmit }, "Re-submit"));
    }
    buttons.push(h("a", { class: "button", href: `#/submit?capability=${encodeURIComponent(task.capability)}&from=${task.task_id}` }, "Edit and submit"));
    actions.replaceChildren(...buttons);
  }

  async function cancel() {
    try {
      show(await post(`tasks/${taskId}/cancel`));
      problem.replaceChildren();
    } catch (error) {
      problem.replaceChildren(alertBox(error));
    }
  }

  async function resubmit() {
    const envelope = { capability: task.capability, payload: task.payload, metadata: task.metadata };
    if (task.session_id) envelope.session_id = task.session_id;
    try {
      const created = await post("tasks", envelope);
      window.location.hash = `#/tasks/${created.task_id}`;
    } catch (error) {
      problem.replaceChildren(alertBox(error));
    }
  }

  function record(frame) {
    const { type, data, seq, at } = frame.data;
    timeline.append(h("li", { "data-type": type },
      h("span", { class: "seq" }, `#${seq}`), " ", h("strong", {}, type), " ",
      h("span", { class: "muted" }, when(at, { timeOnly: true })), " ", summary(type, data)));
    if (type === "output") {
      outputs.append(h("li", {}, typeof data === "string" ? data : h("code", {}, JSON.stringify(data))));
    } else if (type === "progress") {
      showProgress(data);
    } else if (type === "status") {
      show({ status: data.status });
    }
  }

  async function follow() {
    let after = 0;
    for (;;) {
      try {
        live.textContent = "live";
        for await (const frame of events(taskId, { after, signal: stop.signal })) {
          after = Number(frame.id) || after;
          record(frame);
          if (FINAL.includes(frame.data.type)) {
            live.textContent = "ended";
            show(await get(`tasks/${taskId}?include=payload`, { signal: stop.signal }));
            return;
          }
        }
      } catch (error) {
        if (stop.signal.aborted) return;
        if (error.status && error.status < 500) {
          live.textContent = "stopped";
          problem.replaceChildren(alertBox(error));
          return;
        }
      }
      if (stop.signal.aborted) return;
      live.textContent = "reconnecting…";
      await new Promise((resolve) => setTimeout(resolve, RECONNECT_MS));
    }
  }

  // Its callback's deliveries and its subscriptions' (the final one comes after the end).
  const id = encodeURIComponent(taskId);
  const redeliver = (deliveryId) => act(
    () => post(`tasks/${id}/deliveries/${deliveryId}/redeliver`), "Sent again.", deliveryStatus,
    () => sent.refresh());
  const sent = poll({
    every: DELIVERIES_MS,
    read: () => get(`tasks/${id}/deliveries`, { signal: stop.signal }),
    show: (found) => {
      deliveries.replaceChildren(...found.deliveries.map((d) => delivery(d, redeliver)));
      if (!found.deliveries.length) {
        deliveries.append(h("p", { class: "muted" }, "No callback or subscription has been sent this task's events."));
      }
    },
    problem: deliveryStatus,
  });

  get(`tasks/${encodeURIComponent(taskId)}?include=payload`, { signal: stop.signal })
    .then((found) => {
      show(found);
      follow();
    })
    .catch((error) => {
      if (!stop.signal.aborted) problem.replaceChildren(alertBox(error));
    });
  return () => {
    stop.abort();
    sent.stop();
  };
}

function summary(type, data) {
  if (type === "status") {
    const extra = [data.attempt && `attempt ${data.attempt}`, data.instance].filter(Boolean);
    return `${data.status}${extra.length ? ` (${extra.join(", ")})` : ""}`;
  }
  if (type === "progress") return `${data.percent}%${data.message ? ` ${data.message}` : ""}`;
  if (FINAL.includes(type)) return data?.error ? `${data.error.code}: ${data.error.message}` : "";
  const text = JSON.stringify(data);
  return text && text.length > 160 ? `${text.slice(0, 160)}…` : text ?? "";
}
