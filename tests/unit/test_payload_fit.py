"""A payload checked against its card (``broker.tasks.admission.Door.fit``): one of many values
on a thread, so the event loop every tenant's requests share still turns while it runs; a
small one at once, on the loop, with no thread hop."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Iterable, Iterator
from typing import Any

import pytest
from redis.asyncio import Redis

from broker.cache import TimedCache
from broker.errors import InvalidEnvelope
from broker.tasks.admission import CHECK_ON_THREAD_VALUES, Door
from broker.tasks.backpressure import TokenBucket

CARD = {
    "agent_id": "bot",
    "version": "1.0.0",
    "capability": "text.upper",
    "constraints": {"max_payload_bytes": None},
    "input_schema": {"properties": {"xs": {"type": "array", "uniqueItems": True}}},
}


class Passes(list[Any]):
    """A JSON array that notes the thread of each pass over its items."""

    def __init__(self, items: Iterable[Any], threads: set[int]) -> None:
        super().__init__(items)
        self.threads = threads

    def __iter__(self) -> Iterator[Any]:
        self.threads.add(threading.get_ident())
        return super().__iter__()


def fit(items: list[Any]) -> tuple[set[int], int, InvalidEnvelope | None]:
    """(the threads that went over ``items``, the event loop's thread, the refusal if any)."""
    threads: set[int] = set()

    async def check() -> tuple[int, InvalidEnvelope | None]:
        redis = Redis()  # never called: the payload's check reads nothing from Redis
        door = Door(redis, TokenBucket(rate_per_s=1, burst=1))
        try:
            payload = {"xs": Passes(items, threads)}
            await door.fit(CARD, payload, TimedCache(ttl_s=60), tenant="t")
        except InvalidEnvelope as exc:
            return threading.get_ident(), exc
        finally:
            await redis.aclose()
        return threading.get_ident(), None

    loop_thread, refusal = asyncio.run(check())
    return threads, loop_thread, refusal


@pytest.mark.parametrize("duplicate", [False, True], ids=["valid", "refused"])
def test_a_payload_of_many_values_is_checked_off_the_event_loop_a_small_one_on_it(
    duplicate: bool,
) -> None:
    """Checked on the loop, a 1 MiB payload held every tenant's requests for seconds (1.8 s
    for an array of integers; 25 s for one that ``Optional[list[Optional[int]]]`` refused).
    A small one takes no thread hop: a submit's own check costs microseconds."""
    extra = [1] if duplicate else []
    threads, loop_thread, refusal = fit([*range(CHECK_ON_THREAD_VALUES + 1), *extra])
    assert len(threads) == 1 and loop_thread not in threads
    # refused from the thread as on the loop
    expected = [{"field": "payload/xs", "message": "has non-unique elements"}]
    assert (refusal and refusal.details) == ({"errors": expected} if duplicate else None)
    threads, loop_thread, refusal = fit([1, 2, 3, *extra])
    assert threads == {loop_thread}
    assert (refusal and refusal.details) == ({"errors": expected} if duplicate else None)
