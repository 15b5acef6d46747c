"""The free-slot reserve of one tier: when the cleaner starts demoting and when it stops.

Why two marks: with one, the cleaner would wake for every allocation and copy one block at a time; with
a gap it copies a batch once the reserve runs low and then sleeps while the reserve absorbs the next
burst of allocations (hysteresis). The reserve is what lets the request path take a free slot instead
of waiting for a copy (docs/design/kvd.md, "Background cleaning").
"""
from __future__ import annotations

import math


class Watermarks:
    """Marks in blocks: ``low`` = max(1, ceil(clean_low * blocks)), ``high`` likewise and >= low; where that
    ``high`` is below ``min_high`` (capped at a quarter of the tier), ``high`` is raised to it and ``low``
    to at least half of it.
    Only the cleaner (under kvd's lock) calls ``want``; it alone mutates ``cleaning``."""

    def __init__(self, blocks: int, low: float, high: float, min_high: int = 0) -> None:
        self.low = max(1, math.ceil(low * blocks))
        self.high = max(self.low, math.ceil(high * blocks))
        floor = min(min_high, blocks // 4)   # a reserve in blocks (KvdConfig.clean_min_blocks), capped
        if self.high < floor:
            self.low, self.high = max(self.low, floor // 2), floor
        self.cleaning = False  # below low since the last time the reserve reached high

    def want(self, free: int) -> int:
        """How many slots the cleaner should free now, given ``free`` free slots (0: leave it)."""
        if free < self.low:
            self.cleaning = True
        if self.cleaning and free >= self.high:
            self.cleaning = False
        return self.high - free if self.cleaning else 0
