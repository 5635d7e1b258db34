"""The agent SDK: register capabilities with ``@agent.capability`` and use the ``Context``."""

from broker.errors import AgentFailure, Retryable
from workers.sdk.agent import AgentRegistry, CapabilitySpec, agent
from workers.sdk.context import Context

__all__ = [
    "AgentFailure",
    "AgentRegistry",
    "CapabilitySpec",
    "Context",
    "Retryable",
    "agent",
]
