"""SSE streams held open in numbers, with the API's memory and CPU sampled while they are."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections import Counter
from collections.abc import Callable
from typing import Any

from bench.loadgen import HOST, REQUEST_TIMEOUT_S, open_all, post, read_head
from bench.stats import latency_ms


class HeldStream:
    """An SSE response kept open and read to the end in the background."""

    def __init__(self, port: int, raw: bytes) -> None:
        self.port = port
        self.raw = raw
        self.status = 0
        self.first_frame_s: float | None = None
        self.ended = False
        self._writer: asyncio.StreamWriter | None = None
        self._drain: asyncio.Task[None] | None = None

    async def open(self) -> HeldStream:
        started = time.perf_counter()
        try:
            reader, self._writer = await asyncio.open_connection(HOST, self.port)
            self._writer.write(self.raw)
            self.status, _ = await asyncio.wait_for(read_head(reader), REQUEST_TIMEOUT_S)
            if self.status == 200:
                seen = b""
                while b"\n\n" not in seen:  # the end of the first frame
                    chunk = await asyncio.wait_for(reader.read(4096), REQUEST_TIMEOUT_S)
                    if not chunk:
                        raise ConnectionError("closed before the first event")
                    seen += chunk
                self.first_frame_s = time.perf_counter() - started
                self._drain = asyncio.create_task(self._read_to_end(reader))
        except (OSError, TimeoutError, asyncio.IncompleteReadError, ValueError):
            self.ended = True
        return self

    async def _read_to_end(self, reader: asyncio.StreamReader) -> None:
        with contextlib.suppress(OSError):
            while await reader.read(4096):
                pass
        self.ended = True

    @property
    def held(self) -> bool:
        return self.first_frame_s is not None and not self.ended

    async def close(self) -> None:
        if self._drain is not None:
            self._drain.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._drain
        if self._writer is not None:
            self._writer.close()
            with contextlib.suppress(Exception):
                await self._writer.wait_closed()


async def hold_streams(
    port: int,
    token: str,
    document: dict[str, Any],
    *,
    streams: int,
    hold_s: float,
    rss_bytes: Callable[[], int],
    cpu_s: Callable[[], float],
) -> dict[str, Any]:
    """Open ``streams`` SSE responses (POST in stream mode), hold them ``hold_s`` while sampling
    the API's memory, then close them."""
    raw = post(port, "/tasks", token, document)
    rss_before = rss_bytes()
    opened = await open_all(streams, lambda: HeldStream(port, raw).open())
    peak = rss_bytes()
    cpu_before, held_from = cpu_s(), time.perf_counter()
    while (waited := time.perf_counter() - held_from) < hold_s:
        await asyncio.sleep(min(0.5, hold_s - waited))
        peak = max(peak, rss_bytes())
    cpu_share = (cpu_s() - cpu_before) / (time.perf_counter() - held_from)
    held = sum(s.held for s in opened)
    await asyncio.gather(*(s.close() for s in opened))
    firsts = [s.first_frame_s for s in opened if s.first_frame_s is not None]
    return {
        "streams": streams,
        "opened": len(firsts),
        "held_to_the_end": held,
        "statuses": dict(Counter(str(s.status) for s in opened)),
        "hold_s": hold_s,
        "rss_before_mb": round(rss_before / 2**20, 1),
        "rss_peak_mb": round(peak / 2**20, 1),
        "rss_per_stream_kb": round((peak - rss_before) / 1024 / max(1, len(firsts)), 1),
        "api_cpu_while_holding": round(cpu_share, 3),  # cores busy: 1.0 is one full core
        "first_frame": latency_ms(firsts) if firsts else None,
    }
