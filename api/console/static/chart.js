// A capability's series (GET /capabilities/{capability}/series) as a small SVG: tasks per
// minute as bars (failed stacked on succeeded) above p50/p95 run time as lines, on one time
// axis. No library and no inline style (the CSP allows none): shapes carry classes that
// console.css colours, and the viewBox lets it scale with its column.

import { h } from "./dom.js";

const NS = "http://www.w3.org/2000/svg";
const WIDTH = 320;
const HEIGHT = 200;
const LEFT = 44;
const RIGHT = 6;
const RATE = { top: 18, bottom: 78 };
const TIME = { top: 110, bottom: 170 };
const AXIS_LABELS_Y = 186;

function svg(tag, attrs = {}, ...children) {
  const el = document.createElementNS(NS, tag);
  for (const [name, value] of Object.entries(attrs)) {
    if (value !== null && value !== undefined) el.setAttribute(name, String(value));
  }
  for (const child of children.flat()) {
    if (child !== null && child !== undefined) el.append(child instanceof Node ? child : String(child));
  }
  return el;
}

export function duration(value) {
  if (value === null || value === undefined) return "—";
  return value < 1 ? `${Math.round(value * 1000)} ms` : `${value.toFixed(2)} s`;
}

// The smallest of 1, 2 or 5 times a power of ten that is at least `value` (1 for nothing).
function niceMax(value) {
  if (!(value > 0)) return 1;
  const power = 10 ** Math.floor(Math.log10(value));
  return [1, 2, 5, 10].map((m) => m * power).find((m) => m >= value * (1 - 1e-9));
}

// An axis's top: a round number, so without decimals.
function tick(seconds) {
  return seconds < 1 ? `${Math.round(seconds * 1000)} ms` : `${seconds} s`;
}

function clock(iso) {
  return new Date(iso).toLocaleTimeString([], { hour: "2-digit", minute: "2-digit" });
}

const plural = (n, one, many = `${one}s`) => `${n} ${n === 1 ? one : many}`;

function span(windowS) {
  const minutes = Math.round(windowS / 60);
  return minutes % 60 === 0 && minutes > 60 ? `${minutes / 60} hours` : plural(minutes, "minute");
}

// What the chart shows, in words: its accessible name.
export function summarize(series) {
  const { capability, total, buckets, step_s: stepS } = series;
  const when = `the last ${span(series.window_s)}`;
  if (!total.tasks) return `${capability}: no tasks finished in ${when}.`;
  const peak = Math.max(...buckets.map((b) => (b.tasks * 60) / stepS));
  return `${capability}, ${when}: ${plural(total.tasks, "task")} (${total.succeeded} succeeded, `
    + `${total.failed} failed), at most ${Math.round(peak * 10) / 10} a minute; `
    + `run time p50 ${duration(total.p50_run_s)}, p95 ${duration(total.p95_run_s)}.`;
}

function yAxis(panel, max, label) {
  return [
    svg("line", { class: "axis", x1: LEFT, x2: LEFT, y1: panel.top, y2: panel.bottom }),
    svg("line", { class: "axis", x1: LEFT, x2: WIDTH - RIGHT, y1: panel.bottom, y2: panel.bottom }),
    svg("line", { class: "grid", x1: LEFT, x2: WIDTH - RIGHT, y1: panel.top, y2: panel.top }),
    svg("text", { x: LEFT - 4, y: panel.top + 4, "text-anchor": "end" }, max),
    svg("text", { x: LEFT - 4, y: panel.bottom + 4, "text-anchor": "end" }, "0"),
    svg("text", { class: "panel", x: LEFT + 4, y: panel.top - 5 }, label),
  ];
}

function bars(buckets, slot, perMinute, rateMax) {
  const scale = (RATE.bottom - RATE.top) / rateMax;
  const width = Math.max(slot * 0.8, 0.6);
  return buckets.flatMap((b, i) => {
    const x = LEFT + i * slot + (slot - width) / 2;
    let y = RATE.bottom;
    const parts = [["ok", b.succeeded], ["failed", b.failed], ["other", b.tasks - b.succeeded - b.failed]];
    return parts.filter(([, n]) => n > 0).map(([kind, n]) => {
      const height = perMinute(n) * scale;
      y -= height;
      return svg("rect", { class: kind, x: x.toFixed(2), y: y.toFixed(2), width: width.toFixed(2), height: height.toFixed(2) });
    });
  });
}

function line(buckets, slot, field, timeMax) {
  const scale = (TIME.bottom - TIME.top) / timeMax;
  const points = buckets.map((b, i) => (b[field] === null
    ? null
    : [LEFT + (i + 0.5) * slot, TIME.bottom - b[field] * scale]));
  // A gap (a minute without tasks) breaks the line; every point also gets a dot, so a lone
  // minute shows.
  const d = points.map((p, i) => (p ? `${points[i - 1] ? "L" : "M"}${p[0].toFixed(2)} ${p[1].toFixed(2)}` : ""))
    .join(" ").trim();
  return [
    d ? svg("path", { class: `line ${field}`, d }) : null,
    ...points.filter(Boolean).map(([x, y]) => svg("circle", { class: `dot ${field}`, cx: x.toFixed(2), cy: y.toFixed(2), r: 1.8 })),
  ];
}

// The chart of one series as a <figure>: caption, SVG (role img, named by its summary) and
// a legend in text.
export function seriesChart(series) {
  const { buckets, step_s: stepS, capability } = series;
  const slot = (WIDTH - LEFT - RIGHT) / Math.max(buckets.length, 1);
  const perMinute = (n) => (n * 60) / stepS;
  const rateMax = niceMax(Math.max(0, ...buckets.map((b) => perMinute(b.tasks))));
  const timeMax = niceMax(Math.max(0, ...buckets.map((b) => b.p95_run_s ?? 0)));
  const titleId = `chart-title-${capability}`;
  const first = buckets[0];
  const last = buckets[buckets.length - 1];
  const middle = buckets[Math.floor(buckets.length / 2)];
  const image = svg(
    "svg",
    { viewBox: `0 0 ${WIDTH} ${HEIGHT}`, role: "img", "aria-labelledby": titleId, class: "series" },
    svg("title", { id: titleId }, summarize(series)),
    yAxis(RATE, String(rateMax), "tasks per minute"),
    bars(buckets, slot, perMinute, rateMax),
    yAxis(TIME, tick(timeMax), "run time"),
    line(buckets, slot, "p95_run_s", timeMax),
    line(buckets, slot, "p50_run_s", timeMax),
    first ? [
      svg("text", { x: LEFT, y: AXIS_LABELS_Y, "text-anchor": "start" }, clock(first.start_at)),
      svg("text", { x: LEFT + (WIDTH - LEFT - RIGHT) / 2, y: AXIS_LABELS_Y, "text-anchor": "middle" }, clock(middle.start_at)),
      svg("text", { x: WIDTH - RIGHT, y: AXIS_LABELS_Y, "text-anchor": "end" }, `${clock(last.start_at)} now`),
    ] : null,
  );
  return h("figure", { class: "chart", "data-capability": capability },
    h("figcaption", {}, capability),
    image,
    h("ul", { class: "legend", "aria-hidden": "true" },
      [["ok", "succeeded"], ["failed", "failed"], ["other", "stopped"], ["p50", "p50 run"], ["p95", "p95 run"]]
        .map(([kind, label]) => h("li", {}, h("span", { class: `swatch ${kind}` }), label))),
  );
}
