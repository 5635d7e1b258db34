// A JSON schema's top level as form fields, and the payload read back from them.

import { h } from "./dom.js";

const SIMPLE = ["string", "number", "integer", "boolean"];

export function fieldsFor(schema, values = {}) {
  const properties = schema?.type === "object" || schema?.properties ? schema.properties : null;
  if (!properties || !Object.keys(properties).length) {
    const area = textarea("payload-json", "Payload (JSON)", JSON.stringify(values ?? {}, null, 2));
    return { whole: area.input, fields: [], elements: area.elements };
  }
  const required = new Set(schema.required ?? []);
  const fields = Object.entries(properties).map(([name, property]) =>
    // Own properties only: a property named __proto__ or toString is not the object's.
    field(name, property ?? {}, required.has(name), Object.hasOwn(values ?? {}, name) ? values[name] : undefined),
  );
  return { whole: null, fields, elements: fields.flatMap((f) => f.elements) };
}

function field(name, property, required, value) {
  const id = `payload-${name}`;
  const type = Array.isArray(property.type) ? property.type.find((t) => t !== "null") : property.type;
  const label = h("label", { for: id }, name, required ? h("span", { class: "required" }, " *") : "");
  const hint = property.description ? [h("small", { class: "muted" }, property.description)] : [];
  if (!SIMPLE.includes(type)) {
    const area = textarea(id, `${name} (JSON)`, value === undefined ? "" : JSON.stringify(value, null, 2));
    return { name, kind: "json", required, input: area.input, elements: [...area.elements, ...hint] };
  }
  let input;
  if (type === "boolean") {
    input = h("select", { id, name }, ["", "true", "false"].map((v) =>
      h("option", { value: v, selected: String(value ?? "") === v }, v || "—")));
  } else if (Array.isArray(property.enum)) {
    input = h("select", { id, name, required }, required ? "" : h("option", { value: "" }, "—"),
      property.enum.map((v) => h("option", { value: String(v), selected: v === value }, String(v))));
  } else if (type === "string" && !(property.maxLength <= 200)) {
    input = h("textarea", { id, name, required, rows: 4 });
    input.value = value ?? "";
  } else {
    const numeric = type !== "string";
    input = h("input", {
      id, name, required,
      type: numeric ? "number" : "text",
      step: type === "integer" ? "1" : numeric ? "any" : null,
      min: property.minimum, max: property.maximum,
      value: value ?? property.default ?? null,
    });
  }
  return { name, kind: type, required, input, elements: [label, input, ...hint] };
}

function textarea(id, text, value) {
  const input = h("textarea", { id, name: id, rows: 8, class: "mono", spellcheck: "false" });
  input.value = value;
  return { input, elements: [h("label", { for: id }, text), input] };
}

export function readPayload(form) {
  if (form.whole) return parseJson(form.whole.value || "{}", "the payload");
  // Entries made into an object: an assignment to payload["__proto__"] would set no property.
  return Object.fromEntries(form.fields.filter((f) => f.input.value !== "").map((f) => [f.name, value(f)]));
}

function value(f) {
  const raw = f.input.value;
  if (f.kind === "json") return parseJson(raw, f.name);
  if (f.kind === "boolean") return raw === "true";
  if (f.kind === "number" || f.kind === "integer") return Number(raw);
  return raw;
}

function parseJson(text, what) {
  try {
    return JSON.parse(text);
  } catch {
    throw new Error(`${what} is not valid JSON`);
  }
}
