// Every call goes through the public HTTP API with the signed-in key: the console sees what
// the key may see, nothing more. The key lives in sessionStorage: gone with the tab.

const KEY = "agent-reach.api-key";
export const FINAL = ["succeeded", "failed", "cancelled", "expired"];
const root = new URL(".", window.location.href);

export class ApiError extends Error {
  constructor(status, problem) {
    super(problem?.detail ?? `HTTP ${status}`);
    this.status = status;
    this.problem = problem;
  }
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
  const doc = await response.json().catch(() => null);
  if (!response.ok) {
    const error = new ApiError(response.status, doc);
    if (response.status === 401) window.dispatchEvent(new CustomEvent("reach:unauthenticated"));
    throw error;
  }
  return doc;
}

export const get = (path, options) => call("GET", path, undefined, options);
export const post = (path, body, options) => call("POST", path, body, options);
export const put = (path, body, options) => call("PUT", path, body, options);
export const remove = (path, options) => call("DELETE", path, undefined, options);

export function query(params) {
  const found = Object.entries(params).filter(([, v]) => v !== undefined && v !== null && v !== "");
  return found.length ? `?${new URLSearchParams(found)}` : "";
}

// SSE through fetch: EventSource cannot send an Authorization header, and a key in the URL
// would end up in logs. Yields {id, event, data} for each frame; comments (pings) are skipped.
export async function* events(taskId, { after, signal } = {}) {
  const extra = { Accept: "text/event-stream" };
  if (after) extra["Last-Event-ID"] = String(after);
  const url = new URL(`tasks/${encodeURIComponent(taskId)}/events`, root);
  const response = await fetch(url, { headers: headers(extra), signal });
  if (!response.ok) throw new ApiError(response.status, await response.json().catch(() => null));
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
