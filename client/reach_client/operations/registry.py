"""Who serves what: agents with their instances, and capabilities with their figures."""

from __future__ import annotations

from reach_client.models import Agent, Capability
from reach_client.plans import Plan, Request, path, send
from reach_client.retries import RetryPolicy


def agents(policy: RetryPolicy) -> Plan[list[Agent]]:
    answer = yield from send(Request("GET", "/agents"), policy)
    return [Agent.from_json(a) for a in answer.json()["agents"]]


def agent(policy: RetryPolicy, agent_id: str) -> Plan[Agent]:
    answer = yield from send(Request("GET", path("agents", agent_id)), policy)
    return Agent.from_json(answer.json())


def capabilities(policy: RetryPolicy) -> Plan[list[Capability]]:
    answer = yield from send(Request("GET", "/capabilities"), policy)
    return [Capability.from_json(c) for c in answer.json()["capabilities"]]
