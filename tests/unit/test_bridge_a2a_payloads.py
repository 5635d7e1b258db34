"""A tenant's payload on its way to an A2A agent is made protobuf (``ParseDict``, Python
over every node: 0.65-0.9 s for a MiB) off the event loop every tenant's calls share, when it
is big; a small one stays on the loop, spared the thread's hop. The payload here notes the
thread each of its reads ran on; the agent is a loopback server and the call the bridge's own
handler, as in ``test_bridge_a2a.py``."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from typing import Any

import pytest

from tests.unit.test_bridge_a2a import Seen, a2a_agent_at, a_message, ctx, in_a_bridge
from tests.unit.test_bridge_calls import remote
from workers.aio import ON_LOOP_BYTES
from workers.bridge.registry import RemoteRegistry


class Watched(dict[str, Any]):
    """A payload that notes the thread each pass over its keys runs on."""

    threads: list[threading.Thread]

    def __iter__(self) -> Iterator[str]:
        self.threads.append(threading.current_thread())
        return super().__iter__()


def watched(items: int) -> Watched:
    payload = Watched(numbers=list(range(items)))
    payload.threads = []
    return payload


@pytest.mark.parametrize(
    ("items", "on_the_loop"),
    [(40_000, False), (100, True)],  # ~230 KB and ~500 bytes of JSON
)
def test_a_big_payload_is_made_protobuf_off_the_loop_and_a_small_one_on_it(
    items: int, on_the_loop: bool
) -> None:
    payload = watched(items)
    big = len(str(payload["numbers"])) > ON_LOOP_BYTES
    assert big is not on_the_loop
    seen = Seen()

    async def scenario(registry: RemoteRegistry) -> tuple[Any, threading.Thread]:
        async with a2a_agent_at(lambda m, r: a_message(r), seen) as card_url:
            (spec,) = registry.serve(remote("a2a", card_url))
            return await spec.handler(ctx(), payload), threading.current_thread()

    result, loop_thread = in_a_bridge(scenario)
    assert result["text"] == "done"
    assert seen.count("SendMessage") == 1
    assert payload.threads, "the payload was made protobuf"
    assert all((thread is loop_thread) is on_the_loop for thread in payload.threads)
