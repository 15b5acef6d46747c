"""The eviction policy interface: a policy only decides, the core and the tiers do the work.

Protocol between the core (the only caller) and a policy:
- ``on_created(rec, now)``: ``rec`` entered the evictable set of tier ``rec.tier`` (published and
  released, demoted into a tier, unpinned);
- ``on_touched(rec, now)``: ``rec`` was accessed or its hints changed (it may be unevictable now);
- ``on_removed(rec)``: ``rec`` left its tier's evictable set (leased, pinned, moved, dropped);
- ``victims(tier, n)``: up to ``n`` evictable records of ``tier``, first to go first. The core
  then calls ``on_removed`` for each and demotes or drops it.
``tiers`` lists the tiers the policy uses (configured ones only); ``admits(rec, tier)`` gates a
demotion into a lower tier.
"""
from __future__ import annotations

from abc import ABC, abstractmethod

from typing import Callable

from kvd.admission import admit_all
from kvd.block_index import BlockRecord
from kvd.types import Tier


class EvictionPolicy(ABC):
    name: str
    gated = False  # does the configured admission gate apply (kvd.admission)?

    def __init__(
        self, tiers: tuple[Tier, ...], half_life_s: float, gate: Callable[[BlockRecord], bool] = admit_all
    ) -> None:
        self.tiers = tiers  # GPU first; a block evicted from the last one is dropped
        self.half_life_s = half_life_s
        self._gate = gate

    def admits(self, rec: BlockRecord, tier: Tier) -> bool:
        return self._gate(rec)

    @abstractmethod
    def on_created(self, rec: BlockRecord, now: float) -> None: ...

    def on_touched(self, rec: BlockRecord, now: float) -> None:
        """Recency-only policies learn recency from on_created order; nothing to do."""

    @abstractmethod
    def on_removed(self, rec: BlockRecord) -> None: ...

    @abstractmethod
    def victims(self, tier: Tier, n: int) -> list[BlockRecord]: ...
