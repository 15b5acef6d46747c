"""Measured copy rates of promotions, per source tier: what a promotion from DRAM or NVMe costs.

Why an EWMA and defaults: the prefetch budget (kvd/prefetch_budget.py) must price a promotion before
any copy of this run has been timed, so each tier starts from a configured rate (KvdConfig
``promote_dram_gbps`` / ``promote_nvme_gbps``), and every finished promotion moves the estimate
toward what the hardware just did (weight RATE_EWMA: about the last five copies dominate).
"""
from __future__ import annotations

from kvd.types import Tier

RATE_EWMA = 0.2
MIN_SECONDS = 1e-6   # a copy timed at zero (coarse clock) must not make the rate infinite


class TierRates:
    def __init__(self, dram_bps: float, nvme_bps: float) -> None:
        self.bps: dict[Tier, float] = {Tier.GPU: float("inf"), Tier.DRAM: dram_bps, Tier.NVME: nvme_bps}
        self.samples: dict[Tier, int] = {Tier.DRAM: 0, Tier.NVME: 0}

    def seconds(self, tier: Tier, nbytes: int) -> float:
        """Predicted time to promote ``nbytes`` from ``tier`` to the GPU pool (0 for the GPU itself)."""
        return 0.0 if tier == Tier.GPU else nbytes / self.bps[tier]

    def observe(self, tier: Tier, nbytes: int, seconds: float) -> None:
        """Fold one finished copy into the tier's rate."""
        if tier == Tier.GPU:
            return
        rate = nbytes / max(seconds, MIN_SECONDS)
        self.bps[tier] = (1 - RATE_EWMA) * self.bps[tier] + RATE_EWMA * rate
        self.samples[tier] += 1

    def to_dict(self) -> dict[str, float]:
        return {f"promote_{t.name.lower()}_bps": self.bps[t] for t in (Tier.DRAM, Tier.NVME)}
