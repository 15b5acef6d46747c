"""Promote or recompute: where to cut a lookup hit whose blocks sit in DRAM or NVMe.

A hit of c blocks costs the promotions of the lower-tier blocks it needs (predicted from measured
tier rates, kvd/tier_rates.py) and saves recomputing c blocks (the client's measured prefill rate,
sent as seconds per block). Everything past the cut is recomputed, so the best cut maximises
``c * recompute_s - promote_s(c)`` over the ends every group can serve; ties go to the longer hit
(the cache is preferred when it costs nothing). Promotions run while the engine prefills the rest,
so this is conservative: it never promotes what it predicts to be slower than recomputing.
"""
from __future__ import annotations

from typing import Sequence


def best_cut(candidates: Sequence[int], promote_s: Sequence[float], recompute_s: float | None) -> int:
    """``candidates``: servable hit lengths (ascending, 0 included); ``promote_s[i]``: predicted
    promotion seconds of a hit of ``candidates[i]`` blocks; ``recompute_s``: seconds to recompute
    one block, or None (no budget: the longest hit)."""
    if recompute_s is None:
        return candidates[-1]
    best, gain = 0, float("-inf")
    for c, p in zip(candidates, promote_s):
        g = c * recompute_s - p
        if g >= gain:
            best, gain = c, g
    return best
