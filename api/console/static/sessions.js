// Sessions: one session's state and revision, and the revisions with the tasks that wrote them.
// (The API lists no sessions: a session is looked up by its id.)

import { get } from "./api.js";
import { alertBox, collapsible, definitionList, h, when } from "./dom.js";

export function renderSessions(main, params) {
  const wanted = params.get("id") ?? "";
  const input = h("input", { id: "session-id", name: "id", value: wanted, required: true, class: "mono" });
  const problem = h("div", { "aria-live": "polite" });
  const shown = h("div");
  main.append(
    h("h1", {}, "Sessions"),
    h("form", { class: "filters", onsubmit: (event) => {
      event.preventDefault();
      window.location.hash = `#/sessions?id=${encodeURIComponent(input.value.trim())}`;
    } }, h("div", {}, h("label", { for: "session-id" }, "Session id"), input),
    h("button", { type: "submit" }, "Show")),
    problem,
    shown,
  );
  if (!wanted) return;
  const id = encodeURIComponent(wanted);
  Promise.all([get(`sessions/${id}`), get(`sessions/${id}/revisions`)])
    .then(([session, history]) => {
      shown.replaceChildren(
        h("h2", {}, "Revision ", h("span", { id: "session-revision" }, String(session.revision))),
        definitionList([
          ["Session id", h("span", { class: "mono" }, session.session_id)],
          ["Created", when(session.created_at)],
          ["Updated", when(session.updated_at)],
          ["Expires", when(session.expires_at)],
        ]),
        collapsible("State", session.state),
        Object.keys(session.metadata ?? {}).length ? collapsible("Metadata", session.metadata, false) : "",
        h("h2", {}, "Revisions"),
        h("ul", { id: "revisions", class: "timeline plain" },
          history.revisions.map((r) => h("li", { "data-revision": r.revision },
            h("strong", {}, `revision ${r.revision}`), " ", when(r.created_at), " by ",
            r.task_id ? h("a", { href: `#/tasks/${r.task_id}`, class: "mono" }, r.task_id) : "the API",
            collapsible("State", r.state, false)))),
      );
    })
    .catch((error) => problem.replaceChildren(alertBox(error)));
}
