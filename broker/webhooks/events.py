"""The event types a webhook subscriber may name: one per final status, and ``task.progress``."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from broker.tasks.resource import FINAL, STATUSES

PROGRESS = "task.progress"


def event_for_status(status: str) -> str:
    """The event a task status announces: ``succeeded`` -> ``task.succeeded``."""
    return f"task.{status}"


FINAL_EVENTS = tuple(event_for_status(status) for status in STATUSES if status in FINAL)
EVENT_TYPES = (*FINAL_EVENTS, PROGRESS)
# What check_events accepts, for the OpenAPI document.
EVENTS_SCHEMA: dict[str, Any] = {
    "minItems": 1,
    "items": {"type": "string", "enum": list(EVENT_TYPES)},
}


def check_events(events: Iterable[str]) -> list[str]:
    """The event types, deduplicated in order; ValueError on an empty list or unknown name.
    ``task.progress`` is never implied: only a subscriber that names it gets it."""
    chosen = list(dict.fromkeys(events))
    if not chosen:
        raise ValueError("name at least one event type")
    unknown = [e for e in chosen if e not in EVENT_TYPES]
    if unknown:
        raise ValueError(f"unknown event types {unknown}; known: {list(EVENT_TYPES)}")
    return chosen
