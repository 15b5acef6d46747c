"""One cache group ("full", "swa", "draft", ...): its pools, block index and policy, and the mechanics
of moving blocks between its tiers. ``tail_blocks`` None: a hit needs every block of the prefix (full
attention); an int k: only its last k blocks (sliding window, state snapshot; kvd/hybrid_hits.py). The core (kvd/core.py) owns leases and the API; this class owns
where bytes live.

Invariants: a GPU slot is free, holds a published block (``rec.tier == GPU``), is the target of a
promotion (``rec.dest``), or is a write slot of a lease. Only evictable records (no lease, no pin,
not moving) are ever demoted or dropped; demotion copies first, then frees the source.
"""
from __future__ import annotations

import errno
import logging
import time
from collections import Counter
from pathlib import Path

from kvd.admission import GATES, admit_all
from kvd.block_index import BlockIndex, BlockRecord
from kvd.config import KvdConfig
from kvd.eviction import POLICIES, policy_tiers
from kvd.mover import MoveJob
from kvd.tiers import BlockMeta, BlockPool, move
from kvd.tiers.dram import DramPool
from kvd.tiers.gpu import GpuPool
from kvd.tiers.nvme import NvmePool
from kvd.types import Tier

log = logging.getLogger(__name__)


class CacheGroup:
    def __init__(self, name: str, block_bytes: int, cfg: KvdConfig, tag: str, now: float,
                 tail_blocks: int | None = None) -> None:
        self.name = name
        self.block_bytes = block_bytes
        self.tail_blocks = tail_blocks
        self.index = BlockIndex()
        self.counters: Counter[str] = Counter()
        self.nvme_degraded = False
        gpu_n = cfg.blocks_for(cfg.gpu_bytes, cfg.gpu_blocks, block_bytes)
        dram_n = cfg.blocks_for(cfg.dram_bytes, cfg.dram_blocks, block_bytes)
        nvme_n = cfg.blocks_for(cfg.nvme_bytes, cfg.nvme_blocks, block_bytes) if cfg.nvme_dir else 0
        if gpu_n < 1:
            raise ValueError(f"group {name}: no GPU block fits ({block_bytes} bytes per block)")
        tiers = policy_tiers(cfg.policy, dram_n > 0, nvme_n > 0)
        self.pools: dict[Tier, BlockPool] = {Tier.GPU: GpuPool(f"{tag}-{name}", gpu_n, block_bytes, cfg.device, cfg.run_dir)}
        if Tier.DRAM in tiers:
            try:
                self.pools[Tier.DRAM] = DramPool(f"{tag}-{name}", dram_n, block_bytes, cfg.device, cfg.run_dir)
            except OSError as e:  # memory exhaustion: serve with fewer tiers, never crash later
                log.warning("group %s: DRAM tier of %d blocks unavailable (%s); running without it", name, dram_n, e)
                self.counters["dram_unavailable"] += 1
        if Tier.NVME in tiers:
            self.pools[Tier.NVME] = NvmePool(Path(cfg.nvme_dir), name, nvme_n, block_bytes)
        cls = POLICIES[cfg.policy]
        self.policy = cls(tuple(self.pools), cfg.half_life_s, GATES[cfg.admission] if cls.gated else admit_all)
        if Tier.NVME in self.pools:
            self._adopt_recovered(now)

    @property
    def gpu(self) -> GpuPool:
        return self.pools[Tier.GPU]  # type: ignore[return-value]

    # --- slots ----------------------------------------------------------------------------------
    def take_gpu_slots(self, n: int, now: float) -> list[int] | None:
        """``n`` free GPU slots, evicting/demoting as needed; None (nothing taken) if impossible."""
        out: list[int] = []
        for _ in range(n):
            slot = self.free_slot(Tier.GPU, now)
            if slot is None:
                for s in out:
                    self.gpu.free(s)
                return None
            out.append(slot)
        return out

    def free_slot(self, tier: Tier, now: float) -> int | None:
        """One free slot of ``tier``, making room by moving a victim one tier down."""
        pool = self.pools[tier]
        while pool.free_count == 0:
            victims = self.policy.victims(tier, 1)
            if not victims:
                return None
            self.policy.on_removed(victims[0])
            self.evict(victims[0], now)
        return pool.alloc()

    # --- movement -------------------------------------------------------------------------------
    def evict(self, rec: BlockRecord, now: float) -> None:
        """Demote ``rec`` to the next admitting tier, or drop it (already removed from the policy)."""
        lower = self._next_tier(rec)
        if lower is not None and self.policy.admits(rec, lower):
            slot = self.free_slot(lower, now)
            if slot is not None and self._copy_down(rec, lower, slot):
                self.counters["demotions"] += 1
                self.policy.on_created(rec, now)
                return
        elif lower is not None:
            self.counters["admission_rejects"] += 1
        self.drop(rec)

    def _next_tier(self, rec: BlockRecord) -> Tier | None:
        tiers = list(self.pools)
        i = tiers.index(rec.tier) + 1
        if i < len(tiers) and not (tiers[i] == Tier.NVME and self.nvme_degraded):
            return tiers[i]
        return None

    def _copy_down(self, rec: BlockRecord, lower: Tier, slot: int) -> bool:
        src, dst = self.pools[rec.tier], self.pools[lower]
        t0 = time.perf_counter()
        try:
            move(src, rec.slot, dst, slot, BlockMeta(rec.hash, rec.parent, rec.depth))
        except OSError as e:
            dst.free(slot)
            self._degrade(lower, e)
            return False
        finally:   # seconds the caller (the request that needed a slot) waited for copies into each tier
            self.counters[f"demote_{lower.name.lower()}_seconds"] += time.perf_counter() - t0
        self.counters[f"demote_{lower.name.lower()}_blocks"] += 1
        src.free(rec.slot)
        rec.tier, rec.slot = lower, slot
        return True

    def _degrade(self, tier: Tier, e: OSError) -> None:
        """Disk full (or failing): stop admitting to NVMe, warn once, keep serving from the rest."""
        self.counters["nvme_enospc" if e.errno == errno.ENOSPC else "nvme_errors"] += 1
        if tier == Tier.NVME and not self.nvme_degraded:
            self.nvme_degraded = True
            log.warning("group %s: NVMe tier degraded (%s); no longer admitting to NVMe", self.name, e)

    def drop(self, rec: BlockRecord) -> None:
        """Forget ``rec`` and free its slot (already removed from the policy)."""
        self.index.remove(rec.hash)
        self.pools[rec.tier].free(rec.slot)
        self.counters["evictions"] += 1
        parent = self.index.get(rec.parent) if rec.parent is not None else None
        if parent is not None and parent.children == 0:
            self.policy.on_touched(parent, 0.0)  # a new leaf: a candidate again

    def start_promotion(self, rec: BlockRecord, now: float) -> MoveJob | None:
        """Reserve a GPU slot for a leased lower-tier block; the caller queues the returned job."""
        slot = self.free_slot(Tier.GPU, now)
        if slot is None:
            return None
        rec.moving, rec.dest = True, slot
        return MoveJob(rec, self.name, self.pools[rec.tier], rec.slot, self.gpu, slot)

    def finish_promotion(self, job: MoveJob, error: BaseException | None) -> None:
        rec = job.rec
        rec.moving = False
        if error is not None:
            log.warning("group %s: promotion of %s failed (%s); block dropped", self.name, rec.hash.hex(), error)
            self.gpu.free(job.dst_slot)
            self.index.remove(rec.hash)
            job.src.free(job.src_slot)
            self.counters["promotion_errors"] += 1
            return
        job.src.free(job.src_slot)
        rec.tier, rec.slot, rec.dest = Tier.GPU, job.dst_slot, -1
        self.counters["promotions"] += 1

    # --- persistence ----------------------------------------------------------------------------
    def _adopt_recovered(self, now: float) -> None:
        """Index the NVMe entries that survived a restart (their checksums already verified)."""
        nvme: NvmePool = self.pools[Tier.NVME]  # type: ignore[assignment]
        self.counters["nvme_recovered"] = len(nvme.recovered)
        self.counters["nvme_dropped_on_recovery"] = nvme.dropped_on_recovery
        for slot, meta in nvme.recovered:
            if meta.hash in self.index:  # a duplicate entry: keep one, free the other
                nvme.free(slot)
                continue
            rec = BlockRecord(meta.hash, meta.parent, meta.depth, Tier.NVME, slot, t_last=now, sightings=2)
            self.index.insert(rec)
            self.policy.on_created(rec, now)

    def occupancy(self) -> dict[str, dict[str, int]]:
        return {
            t.name.lower(): {"capacity_blocks": p.blocks, "used_blocks": p.used_count, "free_blocks": p.free_count}
            for t, p in self.pools.items()
        }

    def close(self) -> None:
        for p in self.pools.values():
            p.close()
