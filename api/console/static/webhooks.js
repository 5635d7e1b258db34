// Webhooks: the tenant's subscriptions; one subscription's deliveries with every attempt's
// status code, error and latency; redeliver a failed or dead one.

import { get, post, query } from "./api.js";
import { alertBox, badge, h, when } from "./dom.js";

const REFRESH_MS = 3000;
const REDELIVERABLE = ["failed", "dead"];

export function renderWebhooks(main) {
  const problem = h("div", { "aria-live": "polite" });
  const body = h("tbody");
  main.append(
    h("h1", {}, "Webhooks"),
    problem,
    h("div", { class: "scroll" }, h("table", {},
      h("thead", {}, h("tr", {}, ["URL", "Events", "Capabilities", "Status", "Created"].map((t) => h("th", { scope: "col" }, t)))),
      body)),
  );
  get("webhooks")
    .then((found) => {
      body.replaceChildren(...found.webhooks.map((w) => h("tr", { "data-webhook-id": w.webhook_id },
        h("td", {}, h("a", { href: `#/webhooks/${w.webhook_id}` }, w.url), w.description ? h("div", { class: "muted" }, w.description) : ""),
        h("td", {}, (w.events ?? []).join(", ")),
        h("td", {}, (w.capabilities ?? ["*"]).join(", ")),
        h("td", {}, badge(w.status), w.disabled_reason ? h("div", { class: "muted" }, w.disabled_reason) : ""),
        h("td", {}, when(w.created_at)),
      )));
      if (!found.webhooks.length) body.append(h("tr", {}, h("td", { colspan: 5 }, "No subscription.")));
    })
    .catch((error) => problem.replaceChildren(alertBox(error)));
}

export function renderWebhook(main, webhookId) {
  const problem = h("div", { "aria-live": "polite" });
  const title = h("h1", {}, "Webhook");
  const list = h("div", { class: "deliveries" });
  const older = h("button", { type: "button", onclick: () => page(+1) }, "Older");
  const newer = h("button", { type: "button", onclick: () => page(-1) }, "Newer");
  const cursors = [null];
  let next = null;
  let timer = null;
  let stopped = false;
  main.append(h("p", {}, h("a", { href: "#/webhooks" }, "← Webhooks")), title, problem,
    h("h2", {}, "Deliveries"), list, h("nav", { class: "pager", "aria-label": "Pages" }, newer, older));

  function page(step) {
    if (step > 0 && next) cursors.push(next);
    if (step < 0 && cursors.length > 1) cursors.pop();
    refresh();
  }

  async function refresh() {
    clearTimeout(timer);
    try {
      const id = encodeURIComponent(webhookId);
      const [webhook, found] = await Promise.all([
        get(`webhooks/${id}`),
        get(`webhooks/${id}/deliveries${query({ limit: 20, cursor: cursors[cursors.length - 1] })}`),
      ]);
      if (stopped) return;
      title.replaceChildren(webhook.url, " ", badge(webhook.status));
      next = found.next_cursor;
      list.replaceChildren(...found.deliveries.map((d) => delivery(d, redeliver)));
      if (!found.deliveries.length) list.append(h("p", {}, "No delivery yet."));
    } catch (error) {
      if (!stopped) problem.replaceChildren(alertBox(error));
    }
    older.disabled = !next;
    newer.disabled = cursors.length <= 1;
    if (!stopped) timer = setTimeout(refresh, REFRESH_MS);
  }

  async function redeliver(deliveryId) {
    try {
      await post(`webhooks/${encodeURIComponent(webhookId)}/deliveries/${deliveryId}/redeliver`);
      problem.replaceChildren(h("p", { class: "note", role: "status" }, "Sent again."));
      refresh();
    } catch (error) {
      problem.replaceChildren(alertBox(error));
    }
  }

  refresh();
  return () => {
    stopped = true;
    clearTimeout(timer);
  };
}

function delivery(d, redeliver) {
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
