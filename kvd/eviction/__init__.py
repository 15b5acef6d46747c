"""Eviction policies, chosen by ``KvdConfig.policy``; each decides, none moves bytes."""
from __future__ import annotations

from kvd.eviction.base import EvictionPolicy
from kvd.eviction.lru import LruPolicy
from kvd.eviction.lru_offload import LruOffloadPolicy
from kvd.eviction.reuse import ReusePolicy
from kvd.types import Tier

POLICIES: dict[str, type[EvictionPolicy]] = {
    "lru": LruPolicy,
    "lru-offload": LruOffloadPolicy,
    "reuse": ReusePolicy,
}


def policy_tiers(name: str, dram: bool, nvme: bool) -> tuple[Tier, ...]:
    """Which configured tiers a policy uses: ``lru`` is GPU only (as vLLM)."""
    if name == "lru":
        return (Tier.GPU,)
    return (Tier.GPU,) + ((Tier.DRAM,) if dram else ()) + ((Tier.NVME,) if nvme else ())


__all__ = ["EvictionPolicy", "POLICIES", "policy_tiers"]
