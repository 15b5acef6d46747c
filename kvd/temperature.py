"""Block temperature: an access count that decays with a half-life.

Why store (count, t_last) and not a float updated every tick: a decayed count only changes when the
block is touched, and ``log_key`` turns it into a time-invariant number (log2(count) + t_last/half_life)
that orders blocks exactly as their temperatures at any common later time would. Eviction heaps can
then keep a key without re-scoring the whole cache as time passes.
"""
from __future__ import annotations

import math


def decayed(count: float, t_last: float, now: float, half_life_s: float) -> float:
    """The temperature at ``now`` of a count last updated at ``t_last``."""
    return count * 2.0 ** (-(now - t_last) / half_life_s)


def bump(count: float, t_last: float, now: float, half_life_s: float) -> float:
    """The temperature right after one more access at ``now``."""
    return decayed(count, t_last, now, half_life_s) + 1.0


def log_key(count: float, t_last: float, half_life_s: float) -> float:
    """log2 of the temperature, shifted by now/half_life (the same for every block at a given time)."""
    return math.log2(max(count, 1e-300)) + t_last / half_life_s
