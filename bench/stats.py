"""Summary statistics of latency samples, computed in one place so every report agrees.

Percentiles use linear interpolation between order statistics (numpy's default, "type 7"): p50 of
[1, 2, 3, 4] is 2.5. With few samples p99 is close to the maximum; the count is reported next to it.
"""
from __future__ import annotations

import math
from collections.abc import Sequence

PERCENTILES = (50, 95, 99)


class StatsError(ValueError):
    """A statistic of an empty sample, or of a sample holding NaN."""


def percentile(values: Sequence[float], q: float) -> float:
    if not values:
        raise StatsError("percentile of an empty sample")
    if not 0 <= q <= 100:
        raise StatsError(f"percentile {q} is outside [0, 100]")
    ordered = sorted(values)
    if any(math.isnan(v) for v in ordered):
        raise StatsError("sample holds NaN")
    rank = (len(ordered) - 1) * q / 100
    low = math.floor(rank)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (rank - low)


def mean(values: Sequence[float]) -> float:
    if not values:
        raise StatsError("mean of an empty sample")
    return math.fsum(values) / len(values)


def summarize(values: Sequence[float]) -> dict[str, float | int | None]:
    """{"count", "mean", "p50", "p95", "p99"}; an empty sample gives count 0 and None elsewhere."""
    if not values:
        return {"count": 0, "mean": None, **{f"p{q}": None for q in PERCENTILES}}
    return {"count": len(values), "mean": mean(values), **{f"p{q}": percentile(values, q) for q in PERCENTILES}}
