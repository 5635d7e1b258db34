"""Example agents, loaded through ``REACH_AGENTS`` like any user's (the default value)."""

from workers.examples import echo, invoice, model, summarize

__all__ = ["echo", "invoice", "model", "summarize"]
