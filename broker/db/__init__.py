"""Persistence: the schema (``models``), engines, and the operations each side performs."""
