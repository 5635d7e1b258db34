"""Webhooks: tell a caller about its tasks by calling its URL, signed and retried.

Two ways to subscribe: a task's own ``callback`` (signed with the tenant's callback secret)
and a tenant's subscriptions (``POST /webhooks``, each with its own secret). When a task
reaches a final state, ``fanout`` writes one delivery per interested endpoint; each delivery
is a message with a fixed ``webhook-id`` and body, attempted on the schedule until it
succeeds, fails for good, or is dead.

    addresses      the SSRF deny table (pure)
    ssrf           URL rules, the allow setting, resolve once and check (the Guard)
    signing        Standard Webhooks secrets and signatures (pure)
    policy         what an attempt's outcome means, and when to try again (pure)
    subscriptions  subscriptions and the callback secret (API side)
    fanout         deliveries for a task event (worker side)
    deliveries     claiming and recording attempts (worker side)
    upkeep         lost attempts, lost messages, expired bodies and deliveries (the sweep)
    delivery_log   listing deliveries and redelivering (API side)
"""

from __future__ import annotations

from collections.abc import Iterable

from broker.tasks import FINAL, STATUSES

PROGRESS = "task.progress"


def event_for_status(status: str) -> str:
    """The event a task status announces: ``succeeded`` -> ``task.succeeded``."""
    return f"task.{status}"


FINAL_EVENTS = tuple(event_for_status(status) for status in STATUSES if status in FINAL)
EVENT_TYPES = (*FINAL_EVENTS, PROGRESS)


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
