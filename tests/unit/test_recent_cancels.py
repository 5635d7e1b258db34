"""Cancels heard for no call in flight yet (``workers.aio.Calls``): every process hears every
tenant's cancels, so how many other tasks are cancelled must not decide whether one task's
cancel is still known when its call starts; only its age does. The listener's own handling
of each heard cancel (``_cancel``) is called here as its thread calls it."""

from __future__ import annotations

import time
import uuid

from workers import aio
from workers.aio import Calls


def a_calls() -> Calls:
    calls = Calls("redis://127.0.0.1:9/0")  # never started: nothing connects
    calls._listening_since = time.monotonic()  # as if subscribed
    return calls


def test_5000_cancels_of_other_tasks_keep_an_earlier_one_within_its_age() -> None:
    """They were kept by count, 4,096: a burst of other tenants' cancels between a task's
    claim and its call pushed its cancel out, and it ran to its timeout."""
    calls = a_calls()
    early = uuid.uuid4()
    calls._cancel(str(early))
    for _ in range(5000):
        calls._cancel(str(uuid.uuid4()))
    assert early in calls._recent
    assert len(calls._recent) == 5001


def test_a_cancel_past_its_age_is_let_go_and_a_call_claimed_before_it_asks_redis() -> None:
    """What is let go is no longer known here: a call claimed before it was heard reads its
    task's flag (``Calls.run`` asks when the subscription's start is after the claim)."""
    calls = a_calls()
    claimed_at = time.monotonic()
    old = uuid.uuid4()
    calls._cancel(str(old))
    heard_at = calls._recent[old]
    calls._keep(uuid.uuid4(), heard_at + aio.RECENT_CANCEL_S + 1)
    assert old not in calls._recent
    since = calls._listening_since
    assert since is not None and since >= heard_at > claimed_at
