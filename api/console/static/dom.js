// Building the page from data without innerHTML: every value becomes a text node.

export function h(tag, attrs = {}, ...children) {
  const el = document.createElement(tag);
  for (const [name, value] of Object.entries(attrs ?? {})) {
    if (value === null || value === undefined || value === false) continue;
    if (name.startsWith("on")) el.addEventListener(name.slice(2), value);
    else if (name === "class") el.className = value;
    else if (value === true) el.setAttribute(name, "");
    else el.setAttribute(name, String(value));
  }
  for (const child of children.flat(Infinity)) {
    if (child === null || child === undefined || child === false) continue;
    el.append(child instanceof Node ? child : String(child));
  }
  return el;
}

export function pretty(value) {
  return h("pre", { class: "json" }, JSON.stringify(value, null, 2));
}

export function collapsible(title, value, open = true) {
  return h("details", { open }, h("summary", {}, title), pretty(value));
}

// An ISO 8601 string, or seconds since the epoch (stream events' "at").
export function when(value, { timeOnly = false } = {}) {
  if (value === null || value === undefined || value === "") return "—";
  const at = new Date(typeof value === "number" ? value * 1000 : value);
  if (Number.isNaN(at.getTime())) return String(value);
  const text = timeOnly ? at.toLocaleTimeString() : at.toLocaleString();
  return h("time", { datetime: at.toISOString(), title: at.toISOString() }, text);
}

export function badge(status) {
  return h("span", { class: `badge status-${status}`, "data-status": status }, status);
}

export function problemText(error) {
  const p = error?.problem;
  if (p?.detail) return `${p.detail} (${p.code ?? error.status})`;
  return error?.message ?? String(error);
}

export function alertBox(error) {
  return h("p", { class: "error", role: "alert" }, problemText(error));
}

export function definitionList(pairs) {
  return h(
    "dl",
    { class: "fields" },
    pairs.map(([term, value]) => [h("dt", {}, term), h("dd", {}, value ?? "—")]),
  );
}
