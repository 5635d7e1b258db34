"""The agent SDK: register capabilities with ``@agent.capability`` and use the ``Context``."""

from broker.errors import AgentFailure, EventsTooLarge, Retryable
from workers.sdk.agent import AgentRegistry, CapabilitySpec, agent
from workers.sdk.context import Context
from workers.sdk.session import Session, SessionConflict

__all__ = [
    "AgentFailure",
    "AgentRegistry",
    "CapabilitySpec",
    "Context",
    "EventsTooLarge",
    "Retryable",
    "Session",
    "SessionConflict",
    "agent",
]
