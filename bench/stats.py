"""Summaries of measured samples: latency percentiles in milliseconds, rates per second."""

from __future__ import annotations

import contextlib
import math
import time
from collections.abc import Iterator, Sequence


def percentile(samples: Sequence[float], q: float) -> float:
    """The ``q``-th percentile (0..100), linearly interpolated between closest ranks."""
    if not samples:
        raise ValueError("no samples")
    ordered = sorted(samples)
    rank = (len(ordered) - 1) * q / 100
    low, high = math.floor(rank), math.ceil(rank)
    return ordered[low] + (ordered[high] - ordered[low]) * (rank - low)


def latency_ms(
    samples_s: Sequence[float], quantiles: Sequence[int] = (50, 95, 99)
) -> dict[str, float]:
    """``{"p50_ms": ..., ...}`` from samples in seconds, plus the count."""
    summary = {f"p{q}_ms": round(percentile(samples_s, q) * 1000, 3) for q in quantiles}
    summary["samples"] = len(samples_s)
    return summary


def rate(count: int, elapsed_s: float) -> float:
    return round(count / elapsed_s, 1) if elapsed_s > 0 else 0.0


class RoundTrips:
    """Round trips one at a time, each either to a model or agent that answers after
    ``delay_s`` (subtracted) or to the same one answering at once (``instant``). After the
    wait every process on a call's path has slept, and each hop wakes one: the instant
    series tells the work on the path from what that quiet costs it.

    The series run one after the other (``series``), the waited one first, as it always ran
    alone. Alternated call by call, each waited call would follow an instant one, and the
    machine's state after a call carries into the next: on 2026-12-03 the same waited calls
    added 9.4 ms that way against 11.7 ms in a row (``docs/performance.md``)."""

    def __init__(self, delay_s: float) -> None:
        self.delay_s = delay_s
        self.samples: dict[bool, list[float]] = {False: [], True: []}

    @staticmethod
    def series(count: int) -> Iterator[tuple[int, bool]]:
        """``(i, instant)`` for ``count`` waited calls, then ``count`` instant ones."""
        for instant in (False, True):
            for i in range(count):
                yield i, instant

    @contextlib.contextmanager
    def timed(self, *, instant: bool) -> Iterator[None]:
        sent = time.perf_counter()
        yield
        elapsed = time.perf_counter() - sent
        self.samples[instant].append(elapsed if instant else elapsed - self.delay_s)

    def figures(self) -> dict[str, dict[str, float]]:
        """``added_latency`` (the waited calls) and ``added_latency_instant``, each series
        that was made."""
        names = {False: "added_latency", True: "added_latency_instant"}
        return {
            names[instant]: latency_ms(samples, (50, 99))
            for instant, samples in self.samples.items()
            if samples
        }
