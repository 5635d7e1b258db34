// A list that grows live and shows only its last items. An agent may emit as fast as it
// likes: 150,000 outputs, each an item in Outputs and in Timeline, made a million DOM nodes
// and froze the tab of anyone watching. Items added are built only when render() runs (once
// an animation frame), and only the last `limit` of them.

import { h } from "./dom.js";

export const SHOWN = 1000;

export function tailList(list, { limit = SHOWN, noun = "items" } = {}) {
  const note = h("p", { class: "muted earlier", hidden: true });
  let waiting = []; // functions building the items not shown yet, oldest first
  let earlier = 0; // items dropped: removed from the list, or never built

  function drop(count) {
    earlier += count;
    note.hidden = false;
    note.textContent = `${earlier.toLocaleString("en")} earlier ${noun} not shown (the last ${limit.toLocaleString("en")} are).`;
    list.start = earlier + 1; // an <ol>'s numbers still count from the first
  }

  return {
    note,
    add(build) {
      waiting.push(build);
      if (waiting.length > 2 * limit) { // a tab in the background renders nothing
        drop(waiting.length - limit);
        waiting = waiting.slice(-limit);
      }
    },
    render() {
      if (!waiting.length) return;
      const kept = waiting.slice(-limit);
      const skipped = waiting.length - kept.length;
      waiting = [];
      list.append(...kept.map((build) => build()));
      const over = list.childElementCount - limit;
      for (let i = 0; i < over; i++) list.firstElementChild.remove();
      if (skipped + Math.max(0, over)) drop(skipped + Math.max(0, over));
    },
  };
}
