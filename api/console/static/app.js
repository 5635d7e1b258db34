// The console's shell: sign-in, navigation by the URL's fragment, one view at a time.

import { get, session } from "./api.js";
import { alertBox, h } from "./dom.js";
import { renderAgents } from "./agents.js";
import { renderCapabilities } from "./capabilities.js";
import { renderSessions } from "./sessions.js";
import { renderSubmit } from "./submit.js";
import { renderTask } from "./task.js";
import { renderTasks } from "./tasks.js";
import { renderWebhook, renderWebhooks } from "./webhooks.js";

const main = document.getElementById("main");
const nav = document.getElementById("nav");
let cleanup = () => {};

// A fragment's segment as typed: a malformed escape (`%E0%A4%A`) is kept as it stands (the
// API then answers that nothing has that id) rather than throwing and leaving a blank page.
function segment(text) {
  try {
    return decodeURIComponent(text);
  } catch {
    return text;
  }
}

function route() {
  const [path, search = ""] = window.location.hash.replace(/^#/, "").split("?");
  const params = new URLSearchParams(search);
  const parts = path.split("/").filter(Boolean);
  if (parts[0] === "tasks" && parts[1]) return () => renderTask(main, segment(parts[1]));
  if (parts[0] === "submit") return () => renderSubmit(main, params);
  if (parts[0] === "capabilities") return () => renderCapabilities(main);
  if (parts[0] === "agents") return () => renderAgents(main);
  if (parts[0] === "webhooks" && parts[1]) return () => renderWebhook(main, segment(parts[1]));
  if (parts[0] === "webhooks") return () => renderWebhooks(main);
  if (parts[0] === "sessions") return () => renderSessions(main, params);
  return () => renderTasks(main, params);
}

function show() {
  cleanup();
  cleanup = () => {};
  main.replaceChildren();
  if (!session.key()) {
    signIn();
    return;
  }
  nav.hidden = false;
  const here = window.location.hash.split("?")[0] || "#/tasks";
  for (const link of nav.querySelectorAll("a")) {
    if (here.startsWith(link.getAttribute("href"))) link.setAttribute("aria-current", "page");
    else link.removeAttribute("aria-current");
  }
  cleanup = route()() ?? (() => {});
}

function signIn(message) {
  nav.hidden = true;
  const input = h("input", {
    id: "api-key",
    name: "api-key",
    type: "password",
    autocomplete: "off",
    required: true,
    spellcheck: "false",
  });
  const status = h("div", { "aria-live": "polite" }, message ? alertBox({ message }) : null);
  const form = h(
    "form",
    { class: "card sign-in", onsubmit: (event) => attempt(event, input, status) },
    h("h1", {}, "Sign in"),
    h("p", {}, "Use an Agent-Reach API key. It is kept for this browser tab only."),
    h("label", { for: "api-key" }, "API key"),
    input,
    h("button", { type: "submit" }, "Sign in"),
    status,
  );
  main.replaceChildren(form);
  input.focus();
}

let signingIn = false;

async function attempt(event, input, status) {
  event.preventDefault();
  session.signIn(input.value.trim());
  signingIn = true;
  try {
    await get("tasks?limit=1");
  } catch (error) {
    session.signOut();
    status.replaceChildren(alertBox(error));
    input.select();
    return;
  } finally {
    signingIn = false;
  }
  show();
  // As after a followed link: the focus on the page's content, the navigation a Shift+Tab back
  main.focus({ preventScroll: true });
}

window.addEventListener("reach:unauthenticated", () => {
  if (signingIn) return;
  session.signOut();
  cleanup();
  cleanup = () => {};
  signIn("The API key was refused: sign in again.");
});
document.getElementById("sign-out").addEventListener("click", () => {
  session.signOut();
  show();
});
window.addEventListener("hashchange", () => {
  show();
  main.focus({ preventScroll: true });
});
show();
