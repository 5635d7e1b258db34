"""Summaries of measured samples: latency percentiles in milliseconds, rates per second."""

from __future__ import annotations

import math
from collections.abc import Sequence


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
