// Agents: cards, versions, channels, instances with state and last heartbeat; drain (operators).

import { get, post } from "./api.js";
import { badge, collapsible, h } from "./dom.js";
import { act, poll } from "./live.js";

const REFRESH_MS = 5000;

export function renderAgents(main) {
  const list = h("div", { class: "agents" });
  const problem = h("div", { "aria-live": "polite" });
  const status = h("div", { "aria-live": "polite" });
  main.append(h("h1", {}, "Agents"), problem, status, list);

  const drain = (agentId, instance) => act(
    () => post(`agents/${encodeURIComponent(agentId)}/instances/${encodeURIComponent(instance)}/drain`),
    `Drain requested for ${instance}.`, status, () => live.refresh());
  const live = poll({
    every: REFRESH_MS,
    read: () => get("agents"),
    show: (found) => {
      list.replaceChildren(...found.agents.map((agent) => card(agent, drain)));
      if (!found.agents.length) list.append(h("p", {}, "No agent has advertised a card yet."));
    },
    problem,
  });
  return live.stop;
}

function card(agent, drain) {
  const channels = Object.entries(agent.channels ?? {});
  return h("article", { class: "card agent", "data-agent-id": agent.agent_id },
    h("h2", {}, agent.agent_id, " ", h("span", { class: "muted" }, `${agent.live_instances} live`)),
    h("p", {}, "Versions: ", agent.versions.map((v) => [h("span", { class: "version" }, v.version, " ", badge(v.lifecycle)), " "])),
    channels.length ? h("p", {}, "Channels: ", channels.map(([name, c]) =>
      `${name} (${Object.entries(c.versions).map(([v, w]) => `${v}: ${w}`).join(", ")}) `)) : null,
    h("div", { class: "scroll" }, h("table", {},
      h("caption", {}, "Instances"),
      h("thead", {}, h("tr", {}, ["Instance", "State", "Last heartbeat", "Active", "Capabilities", ""].map((t) => h("th", { scope: "col" }, t)))),
      h("tbody", {}, agent.instances.length ? agent.instances.map((i) => h("tr", { "data-instance": i.instance },
        h("td", { class: "mono" }, i.instance ?? "—"),
        h("td", {}, badge(i.state)),
        h("td", {}, `${i.seconds_since_heartbeat.toFixed(1)} s ago`),
        h("td", {}, String(i.active_tasks)),
        h("td", {}, i.capabilities.join(", ")),
        h("td", {}, i.instance && i.state !== "offline"
          ? h("button", { type: "button", onclick: () => drain(agent.agent_id, i.instance) }, "Drain")
          : ""),
      )) : h("tr", {}, h("td", { colspan: 6 }, "No instance."))))),
    h("details", {}, h("summary", {}, `Cards (${agent.cards.length})`),
      agent.cards.map((c) => collapsible(`${c.capability} ${c.version} — ${c.lifecycle}`, c, false))),
  );
}
