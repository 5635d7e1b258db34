"""The agent SDK: register capabilities with ``@agent.capability`` and use the ``Context``."""

from broker.errors import AgentFailure, Retryable
from workers.sdk.context import Context
from workers.sdk.registry import AgentRegistry, CapabilitySpec, agent

__all__ = [
    "AgentFailure",
    "AgentRegistry",
    "CapabilitySpec",
    "Context",
    "Retryable",
    "agent",
]
