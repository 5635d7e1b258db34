// Webhooks: the tenant's subscriptions; one subscription's deliveries with every attempt's
// status code, error and latency; redeliver a failed or dead one.

import { get, pathPart, post, query, remove } from "./api.js";
import { badge, h, when } from "./dom.js";
import { act, pager, poll } from "./live.js";

const REFRESH_MS = 3000;
const REDELIVERABLE = ["failed", "dead"];

const EVENTS = ["task.succeeded", "task.failed", "task.cancelled", "task.expired", "task.progress"];
const FINAL_EVENTS = EVENTS.filter((e) => e !== "task.progress");

// A secret is shown once, when it is made: the API never shows it again.
function secretShown(text, answer) {
  return [text, " Its signing secret, shown this once: ",
    h("code", { id: "webhook-secret" }, answer.secret)];
}

export function renderWebhooks(main) {
  const problem = h("div", { "aria-live": "polite" });
  const status = h("div", { "aria-live": "polite" });
  const body = h("tbody");
  const url = h("input", { id: "webhook-url", name: "url", type: "url", required: true,
    placeholder: "where the events are POSTed (an https URL)", spellcheck: "false" });
  const capabilities = h("input", { id: "webhook-capabilities", name: "capabilities",
    placeholder: "all; or patterns, comma-separated (invoice.*)", spellcheck: "false" });
  const description = h("input", { id: "webhook-description", name: "description", maxlength: 256 });
  const events = EVENTS.map((e) => h("input", { type: "checkbox", name: "events", value: e,
    id: `event-${e}`, checked: FINAL_EVENTS.includes(e) }));
  const form = h("form", { class: "card webhook-form", onsubmit: create },
    h("h2", {}, "New subscription"),
    h("label", { for: "webhook-url" }, "URL"), url,
    h("fieldset", {}, h("legend", {}, "Events"),
      events.map((box) => h("div", {}, box, " ", h("label", { for: box.id }, box.value)))),
    h("label", { for: "webhook-capabilities" }, "Capabilities"), capabilities,
    h("label", { for: "webhook-description" }, "Description"), description,
    h("div", {}, h("button", { type: "submit" }, "Subscribe")),
  );
  main.append(
    h("h1", {}, "Webhooks"),
    problem,
    status,
    h("div", { class: "scroll" }, h("table", {},
      h("thead", {}, h("tr", {}, ["URL", "Events", "Capabilities", "Status", "Created", ""].map((t) => h("th", { scope: "col" }, t)))),
      body)),
    form,
  );

  function create(event) {
    event.preventDefault();
    const spec = {
      url: url.value.trim(),
      events: events.filter((box) => box.checked).map((box) => box.value),
      capabilities: capabilities.value.split(",").map((c) => c.trim()).filter(Boolean),
    };
    if (description.value.trim()) spec.description = description.value.trim();
    act(() => post("webhooks", spec), (made) => secretShown(`Subscribed ${made.url}.`, made),
      status, () => {
        form.reset();
        live.refresh();
      });
  }

  function unsubscribe(w) {
    if (!window.confirm(`Delete the subscription to ${w.url}? Its deliveries stop.`)) return;
    act(() => remove(`webhooks/${pathPart(w.webhook_id)}`), `Deleted ${w.url}.`, status,
      () => live.refresh());
  }

  const live = poll({
    read: () => get("webhooks"),
    show: (found) => {
      body.replaceChildren(...found.webhooks.map((w) => h("tr", { "data-webhook-id": w.webhook_id },
        h("td", {}, h("a", { href: `#/webhooks/${w.webhook_id}` }, w.url), w.description ? h("div", { class: "muted" }, w.description) : ""),
        h("td", {}, (w.events ?? []).join(", ")),
        h("td", {}, (w.capabilities?.length ? w.capabilities : ["*"]).join(", ")),
        h("td", {}, badge(w.status), w.disabled_reason ? h("div", { class: "muted" }, w.disabled_reason) : ""),
        h("td", {}, when(w.created_at)),
        h("td", {}, h("button", { type: "button", class: "danger", onclick: () => unsubscribe(w),
          "aria-label": `Delete ${w.url}` }, "Delete")),
      )));
      if (!found.webhooks.length) body.append(h("tr", {}, h("td", { colspan: 6 }, "No subscription.")));
    },
    problem,
  });
  return live.stop;
}

export function renderWebhook(main, webhookId) {
  const id = pathPart(webhookId);
  const problem = h("div", { "aria-live": "polite" });
  const status = h("div", { "aria-live": "polite" });
  const title = h("h1", {}, "Webhook");
  const list = h("div", { class: "deliveries" });
  const pages = pager(() => live.refresh());
  const rotate = () => act(() => post(`webhooks/${id}/rotate-secret`),
    (rotated) => secretShown("A new secret signs from now on (the old one signs beside it for a grace period).", rotated),
    status);
  main.append(h("p", {}, h("a", { href: "#/webhooks" }, "← Webhooks")), title, problem, status,
    h("div", { class: "actions" }, h("button", { type: "button", onclick: rotate }, "Rotate secret")),
    h("h2", {}, "Deliveries"), list, pages.nav);

  const redeliver = (deliveryId) => act(
    () => post(`webhooks/${id}/deliveries/${deliveryId}/redeliver`), "Sent again.", status, () => live.refresh());
  const live = poll({
    every: REFRESH_MS,
    read: () => Promise.all([
      get(`webhooks/${id}`),
      get(`webhooks/${id}/deliveries${query({ limit: 20, cursor: pages.cursor() })}`),
    ]),
    show: ([webhook, found]) => {
      title.replaceChildren(webhook.url, " ", badge(webhook.status));
      pages.shown(found.next_cursor);
      list.replaceChildren(...found.deliveries.map((d) => delivery(d, redeliver)));
      if (!found.deliveries.length) list.append(h("p", {}, "No delivery yet."));
    },
    problem,
  });
  return live.stop;
}

export function delivery(d, redeliver) {
  return h("article", { class: "card delivery", "data-delivery-id": d.delivery_id },
    h("h3", {}, d.event_type, " ", badge(d.status), " ",
      h("span", { class: "muted" }, `${d.attempt_count} attempt${d.attempt_count === 1 ? "" : "s"}`)),
    h("p", {}, "Task ", h("a", { href: `#/tasks/${d.task_id}`, class: "mono" }, d.task_id), " · ",
      when(d.created_at), d.last_error ? [" · ", h("span", { class: "error-text" }, d.last_error)] : ""),
    REDELIVERABLE.includes(d.status)
      ? h("button", { type: "button", onclick: () => redeliver(d.delivery_id) }, "Redeliver")
      : "",
    h("div", { class: "scroll" }, h("table", { class: "attempts" },
      h("caption", {}, "Attempts"),
      h("thead", {}, h("tr", {}, ["#", "At", "Status code", "Latency", "Error"].map((t) => h("th", { scope: "col" }, t)))),
      h("tbody", {}, d.attempts.map((a) => h("tr", {},
        h("td", {}, String(a.attempt)),
        h("td", {}, when(a.at)),
        h("td", { class: "status-code" }, a.status_code === null ? "—" : String(a.status_code)),
        h("td", {}, a.latency_ms === null ? "—" : `${a.latency_ms} ms`),
        h("td", {}, a.error ?? ""),
      ))))),
  );
}
