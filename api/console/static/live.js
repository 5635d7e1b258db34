// What every live view does the same way: read the API again and again while it is shown,
// page through a listing's cursors, and report what an action did.

import { alertBox, h } from "./dom.js";

// read() now and then every `every` ms (once if 0) until stop(); show() what it found, or the
// error in `problem`. A refresh() asked for while a read is under way wins: the older read's
// answer is dropped, and only the newest one schedules the next.
export function poll({ every = 0, read, show, problem }) {
  let stopped = false;
  let timer = null;
  let turn = 0;
  async function refresh() {
    clearTimeout(timer);
    const mine = ++turn;
    try {
      const found = await read();
      if (stopped || mine !== turn) return;
      problem.replaceChildren();
      show(found);
    } catch (error) {
      if (stopped || mine !== turn) return;
      problem.replaceChildren(alertBox(error));
    }
    if (every) timer = setTimeout(refresh, every);
  }
  refresh();
  return {
    refresh,
    stop() {
      stopped = true;
      clearTimeout(timer);
    },
  };
}

// Newer / Older through a listing: cursor() is the current page's; after each page is read,
// shown(next_cursor) sets the buttons.
export function pager(onPage) {
  const cursors = [null]; // the cursor of each page shown so far; the last is the current one
  let next = null;
  const older = h("button", { type: "button", disabled: true, onclick: () => {
    if (next) cursors.push(next);
    onPage();
  } }, "Older");
  const newer = h("button", { type: "button", disabled: true, onclick: () => {
    if (cursors.length > 1) cursors.pop();
    onPage();
  } }, "Newer");
  return {
    nav: h("nav", { class: "pager", "aria-label": "Pages" }, newer, older),
    cursor: () => cursors[cursors.length - 1],
    shown(nextCursor) {
      next = nextCursor;
      older.disabled = !next;
      newer.disabled = cursors.length <= 1;
    },
  };
}

// Run an action (a POST); say `done` in `status` (text, or a function of the answer giving
// what to show), or the problem, then call `after`.
export async function act(request, done, status, after = () => {}) {
  try {
    const answer = await request();
    status.replaceChildren(h("p", { class: "note", role: "status" },
      typeof done === "function" ? done(answer) : done));
    after();
  } catch (error) {
    status.replaceChildren(alertBox(error));
  }
}
