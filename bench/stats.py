"""Summary statistics of latency samples, computed in one place so every report agrees.

Percentiles use linear interpolation between order statistics (numpy's default, "type 7"): p50 of
[1, 2, 3, 4] is 2.5. With few samples p99 is close to the maximum; the count is reported next to it.
"""
from __future__ import annotations

import math
import random
import statistics
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


def tau(verifications: int, accepted: int) -> float | None:
    """Tokens a verification keeps: its accepted draft tokens plus the one token the target model adds
    (a correction or the bonus), so plain decoding's τ would be 1. None without verifications: a run or a
    turn that never drafted has no τ, and 0 or 1 there would read as a measured acceptance."""
    return (verifications + accepted) / verifications if verifications else None


def summarize(values: Sequence[float]) -> dict[str, float | int | None]:
    """{"count", "mean", "p50", "p95", "p99"}; an empty sample gives count 0 and None elsewhere."""
    if not values:
        return {"count": 0, "mean": None, **{f"p{q}": None for q in PERCENTILES}}
    return {"count": len(values), "mean": mean(values), **{f"p{q}": percentile(values, q) for q in PERCENTILES}}


def geomean_interval(ratios: Sequence[float], resamples: int = 10_000, seed: int = 0) -> tuple[float, float, float]:
    """(geometric mean, low, high): the ratios' geometric mean and a bootstrap 95% interval of it (the
    ratios resampled with replacement, seeded, so a report's figures are reproducible).

    Why the geometric mean: a ratio of 0.5 and one of 2 cancel; their arithmetic mean (1.25) does not. Why a
    bootstrap: per-repeat ratios of one config against its baseline on these machines are skewed by rare slow
    repeats, so a normal interval would put the bounds in the wrong places."""
    return _log_interval(ratios, lambda logs: math.fsum(logs) / len(logs), resamples, seed, "geometric mean")


def median_interval(ratios: Sequence[float], resamples: int = 10_000, seed: int = 0) -> tuple[float, float, float]:
    """(median, low, high): the ratios' median (taken on their logs, so an even sample's middle pair meets
    at its geometric mean) and a bootstrap 95% interval of it, seeded as ``geomean_interval``'s.

    Why beside the geometric mean: the host's drift makes per-repeat ratios heavy-tailed (session 40, H200
    at c = 32: single runs 10-20% off), and one slow repeat moves a mean where it barely moves a median;
    there the A/A row's interval was ±0.45% around its median against ±1.0% around its mean."""
    return _log_interval(ratios, statistics.median, resamples, seed, "median")


def _log_interval(ratios: Sequence[float], centre, resamples: int, seed: int,
                  name: str) -> tuple[float, float, float]:
    """``centre`` of the ratios' logs, exponentiated, with a seeded bootstrap 95% interval of it."""
    if not ratios:
        raise StatsError(f"{name} of an empty sample")
    if any(not r > 0 for r in ratios):
        raise StatsError("ratios must be positive")
    logs = [math.log(r) for r in ratios]
    rng = random.Random(seed)
    lo, hi = bootstrap_bounds([centre(rng.choices(logs, k=len(logs))) for _ in range(resamples)])
    return math.exp(centre(logs)), math.exp(lo), math.exp(hi)


def bootstrap_bounds(draws: Sequence[float]) -> tuple[float, float]:
    """A 95% percentile interval from bootstrap draws: their 2.5th and 97.5th order statistics (no
    interpolation, so a small sample's bounds are draws that happened)."""
    if not draws:
        raise StatsError("bounds of no draws")
    ordered = sorted(draws)
    return ordered[int(0.025 * len(ordered))], ordered[int(0.975 * len(ordered)) - 1]
