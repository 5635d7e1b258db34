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
    before = gc.get_threshold()
    chosen = bridge_runtime()
    assert before[0] != chosen["gc_gen0_threshold"]  # or the check below says nothing
    figures = as_the_bridge(_where())
    assert figures["loop"].split(".")[0] == chosen["event_loop"]
    assert figures["gen0"] == chosen["gc_gen0_threshold"]
    assert figures["runtime"] == chosen
    assert gc.get_threshold() == before
