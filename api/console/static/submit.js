// Submit a task: the capability's card input schema becomes a form (top-level strings,
// numbers, integers and booleans get fields of their own, anything else a JSON text area).

import { get, pathPart, post } from "./api.js";
import { alertBox, h } from "./dom.js";
import { fieldsFor, readPayload } from "./schema_form.js";

export function renderSubmit(main, params) {
  const problem = h("div", { "aria-live": "polite" });
  const choice = h("select", { id: "submit-capability", name: "capability", required: true });
  const described = h("p", { class: "muted", id: "capability-description" });
  const fields = h("fieldset", {}, h("legend", {}, "Payload"));
  const session = h("input", { id: "submit-session", name: "session_id" });
  const idempotency = h("input", { id: "submit-idempotency", name: "idempotency_key" });
  const button = h("button", { type: "submit" }, "Submit");
  let cards = {};
  let form = null;
  let stopped = false;

  main.append(
    h("h1", {}, "Submit a task"),
    h(
      "form",
      { class: "card submit", onsubmit: submit },
      h("label", { for: "submit-capability" }, "Capability"),
      choice,
      described,
      fields,
      h(
        "details",
        {},
        h("summary", {}, "Envelope options"),
        h("label", { for: "submit-session" }, "Session id"),
        session,
        h("label", { for: "submit-idempotency" }, "Idempotency key"),
        idempotency,
      ),
      button,
      problem,
    ),
  );

  function build(values) {
    const card = cards[choice.value];
    // An agent's own words each in a <bdi>: a direction mark in one stays in it.
    described.replaceChildren(
      ...(card
        ? [h("bdi", {}, card.display_name ?? card.agent_id), ` ${card.version}`,
          ...(card.description ? [" — ", h("bdi", {}, card.description)] : [])]
        : []),
    );
    form = fieldsFor(card?.input_schema ?? {}, values);
    fields.replaceChildren(h("legend", {}, "Payload"), ...form.elements);
  }

  async function submit(event) {
    event.preventDefault();
    problem.replaceChildren();
    let envelope;
    try {
      envelope = { capability: choice.value, payload: readPayload(form) };
    } catch (error) {
      problem.replaceChildren(alertBox(error));
      return;
    }
    if (session.value.trim()) envelope.session_id = session.value.trim();
    if (idempotency.value.trim()) envelope.idempotency_key = idempotency.value.trim();
    button.disabled = true;
    try {
      const task = await post("tasks", envelope);
      window.location.hash = `#/tasks/${task.task_id}`;
    } catch (error) {
      problem.replaceChildren(alertBox(error));
    } finally {
      button.disabled = false;
    }
  }

  async function load() {
    const [agents, previous] = await Promise.all([
      get("agents"),
      params.get("from") ? get(`tasks/${pathPart(params.get("from"))}?include=payload`) : null,
    ]);
    if (stopped) return;
    cards = newestCards(agents.agents);
    const names = Object.keys(cards).sort();
    const wanted = previous?.capability ?? params.get("capability");
    choice.replaceChildren(
      ...names.map((name) => h("option", { value: name, selected: name === wanted }, name)),
    );
    choice.addEventListener("change", () => build({}));
    build(previous?.payload ?? {});
  }

  load().catch((error) => {
    if (!stopped) problem.replaceChildren(alertBox(error));
  });
  return () => {
    stopped = true;
  };
}

// capability -> the card seen last (the one a new task most likely meets)
function newestCards(agents) {
  const found = {};
  for (const agent of agents) {
    for (const card of agent.cards) {
      if (card.lifecycle === "revoked") continue;
      const known = found[card.capability];
      if (!known || (card.last_seen_at ?? "") > (known.last_seen_at ?? "")) {
        found[card.capability] = card;
      }
    }
  }
  return found;
}
