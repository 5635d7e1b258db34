// Agents: cards, versions, channels, instances with state and last heartbeat; drain, revoke
// and channels (operators: the API refuses anyone else).

import { get, pathPart, post, put, remove } from "./api.js";
import { badge, collapsible, h } from "./dom.js";
import { act, poll } from "./live.js";

const REFRESH_MS = 5000;

export function renderAgents(main) {
  const list = h("div", { class: "agents" });
  const problem = h("div", { "aria-live": "polite" });
  const status = h("div", { "aria-live": "polite" });
  const known = h("datalist", { id: "known-agents" });
  const agentId = h("input", { id: "channel-agent", name: "agent_id", list: "known-agents", required: true, spellcheck: "false" });
  const channel = h("input", { id: "channel-name", name: "channel", required: true, placeholder: "stable", spellcheck: "false" });
  const weights = h("input", { id: "channel-weights", name: "weights", required: true, placeholder: "1.0.0=90, 2.0.0=10", spellcheck: "false" });
  const form = h("form", { class: "card channel-form", onsubmit: setChannel },
    h("h2", {}, "Set a channel"),
    h("p", { class: "muted" }, "Operators: the weights of versions a target AGENT@CHANNEL routes by (stable: every untargeted request)."),
    h("label", { for: "channel-agent" }, "Agent"), agentId, known,
    h("label", { for: "channel-name" }, "Channel"), channel,
    h("label", { for: "channel-weights" }, "Weights"), weights,
    h("div", {}, h("button", { type: "submit" }, "Set channel")));
  main.append(h("h1", {}, "Agents"), problem, status, list, form);

  const agentPath = (id) => `agents/${pathPart(id)}`;
  const done = () => live.refresh();
  const ops = {
    drain: (id, instance) => act(
      () => post(`${agentPath(id)}/instances/${pathPart(instance)}/drain`),
      `Drain requested for ${instance}.`, status, done),
    revoke: (id, version) => {
      if (!window.confirm(`Revoke ${id}@${version}? It gets no traffic again, for good.`)) return;
      act(() => post(`${agentPath(id)}/versions/${pathPart(version)}/revoke`),
        `Revoked ${id}@${version}.`, status, done);
    },
    dropChannel: (id, name) => act(
      () => remove(`${agentPath(id)}/channels/${pathPart(name)}`),
      `Removed the channel ${name} of ${id}.`, status, done),
  };

  function setChannel(event) {
    event.preventDefault();
    const versions = Object.fromEntries(weights.value.split(",").map((pair) => pair.trim()).filter(Boolean)
      .map((pair) => {
        const [version, weight] = pair.split("=").map((part) => part.trim());
        return [version, Number(weight)];
      }));
    const id = agentId.value.trim();
    const name = channel.value.trim();
    act(() => put(`${agentPath(id)}/channels/${pathPart(name)}`, { versions }),
      `Set the channel ${name} of ${id}.`, status, () => {
        form.reset();
        done();
      });
  }

  const live = poll({
    every: REFRESH_MS,
    read: () => get("agents"),
    show: (found) => {
      list.replaceChildren(...found.agents.map((agent) => card(agent, ops)));
      if (!found.agents.length) list.append(h("p", {}, "No agent has advertised a card yet."));
      known.replaceChildren(...found.agents.map((a) => h("option", { value: a.agent_id })));
    },
    problem,
  });
  return live.stop;
}

function card(agent, ops) {
  const id = agent.agent_id;
  const channels = Object.entries(agent.channels ?? {});
  return h("article", { class: "card agent", "data-agent-id": id },
    h("h2", {}, id, " ", h("span", { class: "muted" }, `${agent.live_instances} live`)),
    h("p", {}, "Versions: ", agent.versions.map((v) => [h("span", { class: "version", "data-version": v.version },
      v.version, " ", badge(v.lifecycle),
      v.lifecycle === "revoked" ? "" : [" ", h("button", { type: "button", class: "small danger",
        "aria-label": `Revoke ${id}@${v.version}`, onclick: () => ops.revoke(id, v.version) }, "Revoke")]), " "])),
    channels.length ? h("p", {}, "Channels: ", channels.map(([name, c]) => [h("span", { class: "channel", "data-channel": name },
      `${name} (${Object.entries(c.versions).map(([v, w]) => `${v}: ${w}`).join(", ")}) `,
      h("button", { type: "button", class: "small", "aria-label": `Remove the channel ${name} of ${id}`,
        onclick: () => ops.dropChannel(id, name) }, "Remove")), " "])) : null,
    h("div", { class: "scroll" }, h("table", {},
      h("caption", {}, "Instances"),
      h("thead", {}, h("tr", {}, ["Instance", "State", "Last heartbeat", "Active", "Capabilities", ""].map((t) => h("th", { scope: "col" }, t)))),
      h("tbody", {}, agent.instances.length ? agent.instances.map((i) => h("tr", { "data-instance": i.instance },
        h("td", { class: "mono" }, i.instance ?? "—"),
        h("td", {}, badge(i.state)),
        h("td", {}, `${i.seconds_since_heartbeat.toFixed(1)} s ago`),
        h("td", {}, i.active_tasks == null ? "—" : String(i.active_tasks)),
        h("td", {}, i.capabilities.join(", ")),
        h("td", {}, i.instance && i.state !== "offline"
          ? h("button", { type: "button", onclick: () => ops.drain(id, i.instance) }, "Drain")
          : ""),
      )) : h("tr", {}, h("td", { colspan: 6 }, "No instance."))))),
    h("details", {}, h("summary", {}, `Cards (${agent.cards.length})`),
      agent.cards.map((c) => collapsible(`${c.capability} ${c.version} — ${c.lifecycle}`, c, false))),
  );
}
