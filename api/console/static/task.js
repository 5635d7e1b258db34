// One task: its fields, payload and result, and its events as they happen (SSE).

import { FINAL, backoffMs, events, get, pathPart, post, transient } from "./api.js";
import { alertBox, badge, collapsible, definitionList, h, pretty, problemText, when } from "./dom.js";
import { tailList } from "./feed.js";
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
  const waiting = h("div", { id: "stream-problem", "aria-live": "polite" });
  const shownOutputs = tailList(outputs, { noun: "outputs" });
  const shownTimeline = tailList(timeline, { noun: "events" });
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
        h("section", {}, h("h2", {}, "Outputs"), shownOutputs.note, outputs),
        h("section", {}, h("h2", {}, "Timeline ", live), waiting, shownTimeline.note, timeline))),
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
          ["Message", isolated(task.error.message)],
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
    barLabel.replaceChildren(`${progress.percent}%`,
      ...(progress.message ? [" — ", isolated(progress.message)] : []));
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
      show(await post(`tasks/${pathPart(taskId)}/cancel`));
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

  // Events change the page once an animation frame at most: the lists get what came since
  // (their last items only), the bar the latest progress. A new status is shown a frame after
  // what came before it, so the page never shows a status ahead of its outputs.
  let frame = 0;
  let nextStatus = null;
  let nextProgress = null;

  function record(event) {
    const { type, data, seq, at } = event.data;
    if (type === "status") {
      paintLists();
      nextStatus = data.status;
    } else if (type === "progress") {
      nextProgress = data;
    } else if (type === "output") {
      shownOutputs.add(() => h("li", {},
        typeof data === "string" ? isolated(data) : h("code", {}, isolated(JSON.stringify(data)))));
    }
    shownTimeline.add(() => h("li", { "data-type": type },
      h("span", { class: "seq" }, `#${seq}`), " ", h("strong", {}, type), " ",
      h("span", { class: "muted" }, when(at, { timeOnly: true })), " ", isolated(summary(type, data))));
    if (!frame) frame = requestAnimationFrame(paint);
  }

  function paintLists() {
    shownOutputs.render();
    shownTimeline.render();
  }

  function paint() {
    cancelAnimationFrame(frame);
    frame = 0;
    if (nextStatus) show({ status: nextStatus });
    if (nextProgress) showProgress(nextProgress);
    nextStatus = nextProgress = null;
    paintLists();
  }

  // Wait before asking again, saying why and for how long; false if the page was left.
  async function pause(error, attempt) {
    const ms = error ? backoffMs(error, attempt) : RECONNECT_MS;
    live.textContent = "reconnecting…";
    if (error) {
      waiting.replaceChildren(h("p", { class: "note", role: "status" },
        `${problemText(error)}: trying again in ${Math.round(ms / 1000)} s.`));
    }
    await new Promise((resolve) => setTimeout(resolve, ms));
    return !stop.signal.aborted;
  }

  // A 429 (too many streams, or requests) or a 5xx is waited out; 401, 403, 404 are final.
  async function follow() {
    let after = 0;
    let failures = 0;
    for (;;) {
      let failed = null;
      try {
        const opened = () => {
          failures = 0;
          waiting.replaceChildren();
          live.textContent = "live";
        };
        for await (const event of events(taskId, { after, signal: stop.signal, opened })) {
          after = Number(event.id) || after;
          record(event);
          if (FINAL.includes(event.data.type)) {
            const found = await read();
            paint();
            show(found);
            waiting.replaceChildren();
            live.textContent = "ended";
            return;
          }
        }
      } catch (error) {
        if (stop.signal.aborted) return;
        if (!transient(error)) {
          live.textContent = "stopped";
          waiting.replaceChildren(alertBox(error));
          return;
        }
        failed = error;
      }
      if (!(await pause(failed, failures))) return;
      if (failed) failures += 1;
    }
  }

  // The task itself, asked for again while the answer is a 429, a 5xx or no answer.
  async function read() {
    for (let failures = 0; ; failures += 1) {
      try {
        return await get(`tasks/${pathPart(taskId)}?include=payload`, { signal: stop.signal });
      } catch (error) {
        if (stop.signal.aborted || !transient(error)) throw error;
        if (!(await pause(error, failures))) throw error;
      }
    }
  }

  // Its callback's deliveries and its subscriptions' (the final one comes after the end).
  const id = pathPart(taskId);
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

  read()
    .then((found) => {
      waiting.replaceChildren();
      show(found);
      follow();
    })
    .catch((error) => {
      if (stop.signal.aborted) return;
      live.textContent = "stopped";
      problem.replaceChildren(alertBox(error));
    });
  return () => {
    stop.abort();
    cancelAnimationFrame(frame);
    sent.stop();
  };
}

// What an agent wrote, kept apart from the text around it: its bidi controls (U+202E ...)
// reorder nothing outside it.
function isolated(text) {
  return h("bdi", {}, text);
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
