"""``lru``: vLLM's prefix cache. GPU only; the least recently released block goes first.

The core re-enters a lease's blocks in reverse chain order on release (vLLM frees a request's blocks
tail first), so within one request the tail is evicted before its head.
"""
from __future__ import annotations

from collections import OrderedDict

from kvd.admission import admit_all
from kvd.block_index import BlockRecord
from kvd.eviction.base import EvictionPolicy
from kvd.types import BlockHash, Tier


class LruPolicy(EvictionPolicy):
    name = "lru"

    def __init__(self, tiers: tuple[Tier, ...], half_life_s: float, gate=admit_all) -> None:
        super().__init__(tiers, half_life_s, gate)
        # per tier: evictable blocks, least recently released first
        self._queues: dict[Tier, OrderedDict[BlockHash, BlockRecord]] = {t: OrderedDict() for t in tiers}

    def on_created(self, rec: BlockRecord, now: float) -> None:
        self._queues[rec.tier][rec.hash] = rec

    def on_removed(self, rec: BlockRecord) -> None:
        self._queues[rec.tier].pop(rec.hash, None)

    def victims(self, tier: Tier, n: int) -> list[BlockRecord]:
        out: list[BlockRecord] = []
        for rec in self._queues[tier].values():
            if len(out) == n:
                break
            out.append(rec)
        return out
