"""A latency summary that costs O(1) per sample: count, total, max and log-spaced buckets for quantiles.

Why buckets and not a list of samples: kvd times every lock acquisition and every verb for its whole life;
a list would grow without bound. Buckets are 2^(1/4) apart (19% wide) from 1 µs, so a quantile read
from them is within 19% of the true sample, enough to tell a 50 µs wait from a 5 ms one.
"""
from __future__ import annotations

import math

FIRST_S = 1e-6      # bucket 0 holds everything up to 1 µs
STEPS_PER_OCTAVE = 4
BUCKETS = 100       # 1 µs * 2^(99/4) ≈ 27 s: anything longer lands in the last bucket


class LatencyStat:
    """Samples in seconds. Not thread-safe by itself: callers record under a lock they already hold
    (or from the one thread that owns the stat)."""

    def __init__(self) -> None:
        self.count = 0
        self.total_s = 0.0
        self.max_s = 0.0
        self._buckets = [0] * BUCKETS

    def record(self, seconds: float) -> None:
        self.count += 1
        self.total_s += seconds
        self.max_s = max(self.max_s, seconds)
        self._buckets[_bucket(seconds)] += 1

    def quantile(self, q: float) -> float:
        """Upper edge of the bucket holding the q-quantile (0 with no samples)."""
        if not self.count:
            return 0.0
        rank = q * self.count
        seen = 0
        for i, n in enumerate(self._buckets):
            seen += n
            if seen >= rank and n:
                return min(_upper(i), self.max_s)
        return self.max_s

    def to_dict(self) -> dict[str, float]:
        return {"count": self.count, "total_s": self.total_s, "max_s": self.max_s,
                "p50_s": self.quantile(0.5), "p99_s": self.quantile(0.99)}


def _bucket(seconds: float) -> int:
    if seconds <= FIRST_S:
        return 0
    return min(BUCKETS - 1, 1 + int(math.log2(seconds / FIRST_S) * STEPS_PER_OCTAVE))


def _upper(i: int) -> float:
    return FIRST_S * 2 ** (i / STEPS_PER_OCTAVE)
