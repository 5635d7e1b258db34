// Every call goes through the public HTTP API with the signed-in key: the console sees what
// the key may see, nothing more. The key lives in sessionStorage: gone with the tab.

const KEY = "agent-reach.api-key";
export const FINAL = ["succeeded", "failed", "cancelled", "expired"];
const root = new URL(".", window.location.href);

export class ApiError extends Error {
  constructor(status, problem, retryAfterS = null) {
    super(problem?.detail ?? `HTTP ${status}`);
    this.status = status;
    this.problem = problem;
    this.retryAfterS = retryAfterS;
  }
}

async function refusal(response) {
  const seconds = Number.parseInt(response.headers.get("Retry-After") ?? "", 10);
  const doc = await response.json().catch(() => null);
  return new ApiError(response.status, doc, Number.isFinite(seconds) ? seconds : null);
}

// Worth asking again: no answer at all (the network), a timeout, a refusal for now (429: too
// many requests or streams) or a server's trouble (5xx). Any other 4xx (401, 403, 404, ...)
// will answer the same next time.
export function transient(error) {
  const status = error?.status;
  return !status || status === 408 || status === 429 || status >= 500;
}

// How long to wait before asking again after `attempt` failures in a row (0 for the first):
// doubling from a second up to 30 s, never sooner than the answer's Retry-After.
export function backoffMs(error, attempt) {
  const doubling = Math.min(30, 2 ** Math.min(attempt, 5));
  return 1000 * Math.max(doubling, error?.retryAfterS ?? 0);
}

export const session = {
  key: () => sessionStorage.getItem(KEY),
  signIn: (key) => sessionStorage.setItem(KEY, key),
  signOut: () => sessionStorage.removeItem(KEY),
};

function headers(extra = {}) {
  return { Authorization: `Bearer ${session.key()}`, ...extra };
}

export async function call(method, path, body, { signal } = {}) {
  const init = { method, headers: headers({ Accept: "application/json" }), signal };
  if (body !== undefined) {
    init.headers["Content-Type"] = "application/json";
    init.body = JSON.stringify(body);
  }
  const response = await fetch(new URL(path, root), init);
  if (response.status === 204) return null;
  if (!response.ok) {
    const error = await refusal(response);
    if (response.status === 401) window.dispatchEvent(new CustomEvent("reach:unauthenticated"));
    throw error;
  }
  return response.json().catch(() => null);
}

export const get = (path, options) => call("GET", path, undefined, options);
export const post = (path, body, options) => call("POST", path, body, options);
export const put = (path, body, options) => call("PUT", path, body, options);
export const remove = (path, options) => call("DELETE", path, undefined, options);

// An id as one segment of an API path. The server decodes an escaped slash before it routes
// (`tasks/<id>%2Fevents` reached the events route), and the browser resolves `.`, `..` and
// their escapes (`%2E`) as it would the path's own: those are escaped twice, so an id typed
// in the address names nothing but that id (the API answers that nothing has it).
export function pathPart(id) {
  const once = encodeURIComponent(id).replace(/%2F/gi, "%252F");
  return once === "." || once === ".." ? once.replaceAll(".", "%252E") : once;
}

export function query(params) {
  const found = Object.entries(params).filter(([, v]) => v !== undefined && v !== null && v !== "");
  return found.length ? `?${new URLSearchParams(found)}` : "";
}

// SSE through fetch: EventSource cannot send an Authorization header, and a key in the URL
// would end up in logs. Yields {id, event, data} for each frame; comments (pings) are skipped.
// opened() is called once the stream is accepted.
export async function* events(taskId, { after, signal, opened = () => {} } = {}) {
  const extra = { Accept: "text/event-stream" };
  if (after) extra["Last-Event-ID"] = String(after);
  const url = new URL(`tasks/${pathPart(taskId)}/events`, root);
  const response = await fetch(url, { headers: headers(extra), signal });
  if (!response.ok) throw await refusal(response);
  opened();
  const reader = response.body.pipeThrough(new TextDecoderStream()).getReader();
  let buffer = "";
  for (;;) {
    const { value, done } = await reader.read();
    if (done) return;
    buffer += value.replace(/\r\n?/g, "\n");
    let end;
    while ((end = buffer.indexOf("\n\n")) >= 0) {
      const frame = parseFrame(buffer.slice(0, end));
      buffer = buffer.slice(end + 2);
      if (frame) yield frame;
    }
  }
}

function parseFrame(text) {
  const frame = { id: null, event: "message", data: [] };
  for (const line of text.split("\n")) {
    if (!line || line.startsWith(":")) continue;
    const colon = line.indexOf(":");
    const field = colon < 0 ? line : line.slice(0, colon);
    const value = colon < 0 ? "" : line.slice(colon + 1).replace(/^ /, "");
    if (field === "data") frame.data.push(value);
    else if (field === "id") frame.id = value;
    else if (field === "event") frame.event = value;
  }
  if (!frame.data.length) return null;
  return { ...frame, data: JSON.parse(frame.data.join("\n")) };
}
