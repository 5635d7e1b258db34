"""The remote phase's direct caller runs as the bridge's process does: on the same event loop,
with the same collector threshold, so the ratio between them is the broker's work alone."""

from __future__ import annotations

import asyncio
import gc
from typing import Any

from bench.remote import as_the_bridge, bridge_runtime


async def _where() -> dict[str, Any]:
    loop = asyncio.get_running_loop()
    return {"loop": type(loop).__module__, "gen0": gc.get_threshold()[0]}


def test_a_direct_run_gets_the_bridge_loop_and_threshold_and_the_process_its_own_back() -> None:
    found = gc.get_threshold()
    # Python's own threshold, whatever ran in this process before (an app served in-process
    # tunes it too): a direct run must change it, and put it back.
    before = (700, *found[1:])
    chosen = bridge_runtime()
    assert before[0] != chosen["gc_gen0_threshold"]
    gc.set_threshold(*before)
    try:
        figures = as_the_bridge(_where())
        assert gc.get_threshold() == before
    finally:
        gc.set_threshold(*found)
    assert figures["loop"].split(".")[0] == chosen["event_loop"]
    assert figures["gen0"] == chosen["gc_gen0_threshold"]
    assert figures["runtime"] == chosen
