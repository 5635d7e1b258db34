"""Agent-Reach domain: envelopes, tasks, capabilities, keys, persistence and dispatch.

This package imports neither the API nor the workers; both depend on it.
"""
