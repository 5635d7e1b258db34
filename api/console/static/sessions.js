// Sessions: the tenant's live sessions, newest first, a page at a time; one session's state
// and revision, the revisions with the tasks that wrote them, and a link to its tasks.

import { get, pathPart, query } from "./api.js";
import { alertBox, collapsible, definitionList, h, when } from "./dom.js";
import { pager, poll } from "./live.js";

export function renderSessions(main, params) {
  const wanted = params.get("id") ?? "";
  const input = h("input", { id: "session-id", name: "id", value: wanted, required: true, class: "mono", spellcheck: "false" });
  const problem = h("div", { "aria-live": "polite" });
  main.append(
    h("h1", {}, "Sessions"),
    h("form", { class: "filters", onsubmit: (event) => {
      event.preventDefault();
      window.location.hash = `#/sessions${query({ id: input.value.trim() })}`;
    } }, h("div", {}, h("label", { for: "session-id" }, "Session id"), input),
    h("button", { type: "submit" }, "Show")),
    problem,
  );
  if (wanted) showSession(main, wanted, problem);
  else return listSessions(main, problem);
}

function listSessions(main, problem) {
  const body = h("tbody");
  const pages = pager(() => listing.refresh());
  main.append(
    h("div", { class: "scroll" }, h("table", { id: "sessions", class: "sessions" },
      h("thead", {}, h("tr", {}, ["Session", "Revision", "Updated", "Expires"].map((t) => h("th", { scope: "col" }, t)))),
      body)),
    pages.nav,
  );

  const listing = poll({
    read: () => get(`sessions${query({ limit: 20, cursor: pages.cursor() })}`),
    show: (found) => {
      pages.shown(found.next_cursor);
      body.replaceChildren(...found.sessions.map((s) => h("tr", { "data-session-id": s.session_id },
        h("td", {}, h("a", { href: `#/sessions${query({ id: s.session_id })}`, class: "mono" }, s.session_id)),
        h("td", {}, String(s.revision)),
        h("td", {}, when(s.updated_at)),
        h("td", {}, when(s.expires_at)),
      )));
      if (!found.sessions.length) body.append(h("tr", {}, h("td", { colspan: 4 }, "No live session.")));
    },
    problem,
  });
  return listing.stop;
}

function showSession(main, sessionId, problem) {
  const shown = h("div");
  main.prepend(h("p", {}, h("a", { href: "#/sessions" }, "← Sessions")));
  main.append(shown);
  const id = pathPart(sessionId);
  Promise.all([get(`sessions/${id}`), get(`sessions/${id}/revisions`)])
    .then(([session, history]) => {
      shown.replaceChildren(
        h("h2", {}, "Revision ", h("span", { id: "session-revision" }, String(session.revision))),
        definitionList([
          ["Session id", h("span", { class: "mono" }, session.session_id)],
          ["Created", when(session.created_at)],
          ["Updated", when(session.updated_at)],
          ["Expires", when(session.expires_at)],
          ["Tasks", h("a", { id: "session-tasks", href: `#/tasks${query({ session_id: session.session_id })}` }, "Tasks of this session")],
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
