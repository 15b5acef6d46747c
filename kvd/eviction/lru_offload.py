"""``lru-offload``: LMCache's default. LRU in every tier; a block evicted from the GPU is demoted to
DRAM (and on to NVMe when one is configured) with no admission gate, and dropped by LRU at the end."""
from __future__ import annotations

from kvd.eviction.lru import LruPolicy


class LruOffloadPolicy(LruPolicy):
    name = "lru-offload"
