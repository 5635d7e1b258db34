"""Example agents, loaded through ``REACH_AGENTS`` like any user's (the default value)."""

from workers.examples import chat, echo, invoice, model, summarize

__all__ = ["chat", "echo", "invoice", "model", "summarize"]
