"""One batch of background demotions: the cleaner's unit of work (kvd/cleaner.py drives it).

Protocol, so that a lease never sees a half-moved or freed block:
1. under kvd's lock, ``CacheGroup.plan_demotions`` picks victims, reserves their destination slots one
   tier down and marks the records ``demoting`` (no longer evictable: nothing frees their source slot);
2. without the lock, ``Demotion.run_batch`` copies the bytes (the source stays valid and readable:
   a lookup may lease the record meanwhile and read its source slot);
3. under the lock again, ``CacheGroup.finish_demotions`` flips each record to its new tier and frees
   the source, or, if the record was leased, pinned, looked up, passed or the copy failed, cancels:
   the record stays where it was and the reserved destination is freed.
"""
from __future__ import annotations

import time
from dataclasses import dataclass

from kvd.block_index import BlockRecord
from kvd.tiers import BlockMeta, BlockPool, move_many


@dataclass(eq=False)
class Demotion:
    rec: BlockRecord
    src: BlockPool
    src_slot: int
    dst: BlockPool
    dst_slot: int
    sightings: int  # rec.sightings when planned: a lookup since then cancels the move

    @staticmethod
    def run_batch(jobs: list["Demotion"]) -> float:
        """Copy a batch that shares one source and one destination pool; returns its wall seconds.
        Copied in source-slot order, so slots adjacent on both sides form runs (CacheGroup pairs them)."""
        t0 = time.perf_counter()
        if jobs:
            jobs = sorted(jobs, key=lambda j: j.src_slot)
            move_many(jobs[0].src, [j.src_slot for j in jobs], jobs[0].dst, [j.dst_slot for j in jobs],
                      [BlockMeta(j.rec.hash, j.rec.parent, j.rec.depth) for j in jobs])
        return time.perf_counter() - t0

    def still_wanted(self) -> bool:
        """May the move land: nobody leased, pinned, looked up or passed the block while it was copied."""
        r = self.rec
        return r.refs == 0 and not r.pinned and not r.moving and not r.passed and r.sightings == self.sightings
