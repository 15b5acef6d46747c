"""One cache group ("full", "swa", "draft", ...): its pools, block index and policy, and the mechanics
of moving blocks between its tiers. ``tail_blocks`` None: a hit needs every block of the prefix (full
attention); an int k: only its last k blocks (sliding window, state snapshot; kvd/hybrid_hits.py). The core (kvd/core.py) owns leases and the API; this class owns
where bytes live.

Invariants: a GPU slot is free, holds a published block (``rec.tier == GPU``), is the target of a
promotion (``rec.dest``), is a write slot of a lease, or is the destination of a demotion in flight.
Only evictable records (no lease, no pin, not moving either way) are ever demoted or dropped; a
demotion copies first, then frees the source. The request path never copies: demotions are the
background cleaner's (kvd/cleaner.py, kvd/demotion.py); under pressure a request drops a victim.
"""
from __future__ import annotations

import errno
import logging
from collections import Counter
from pathlib import Path

from typing import Callable

from kvd.admission import GATES, admit_all
from kvd.block_index import BlockIndex, BlockRecord
from kvd.config import KvdConfig
from kvd.demotion import Demotion
from kvd.eviction import POLICIES, policy_tiers
from kvd.promotion import Promotion
from kvd.tiers import BlockPool
from kvd.tiers.dram import DramPool
from kvd.tiers.gpu import GpuPool
from kvd.tiers.nvme import NvmePool
from kvd.types import Tier
from kvd.watermarks import Watermarks

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
        # free-slot reserves of the tiers that have a tier below them (kvd/watermarks.py)
        # (with a floor in blocks: requests wait for the GPU's free slots, and the tier below must take a GPU
        # refill's demotions without spilling, so it gets the same floor)
        self.marks = {t: Watermarks(self.pools[t].blocks, cfg.clean_low, cfg.clean_high, cfg.clean_min_blocks)
                      for t in list(self.pools)[:-1]}
        self.inflight: Counter[Tier] = Counter()   # per source tier: demotions planned, not yet finished
        self.wake: Callable[[], None] = lambda: None                     # the core's cleaner.wake
        self.wait_for_room: Callable[[CacheGroup, Tier], None] = lambda g, t: None   # the core's pressure wait
        self.promote_s: Callable[[Tier, int], float] = lambda t, n: 0.0   # the core's TierRates.seconds
        self.recompute_s: float | None = None     # the client's latest price of recomputing one block (lookup)
        self.skip_unpaid_nvme = cfg.skip_unpaid_nvme
        cls = POLICIES[cfg.policy]
        self.policy = cls(tuple(self.pools), cfg.half_life_s, GATES[cfg.admission] if cls.gated else admit_all)
        if Tier.NVME in self.pools:
            self._adopt_recovered(now)

    @property
    def gpu(self) -> GpuPool:
        return self.pools[Tier.GPU]  # type: ignore[return-value]

    # --- slots (the request path: never copies) ------------------------------------------------
    def take_gpu_slots(self, n: int, now: float) -> list[int] | None:
        """``n`` free GPU slots, dropping victims under pressure; None (nothing taken) if impossible."""
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
        """One free slot of ``tier`` for a request. Never copies: with none free it wakes the cleaner,
        optionally waits for it (``wait_for_room``, KvdConfig.pressure_wait_ms), then drops the policy's
        victim (a cache may always forget; ``pressure_drops`` counts victims a lower tier would have kept)."""
        pool = self.pools[tier]
        if pool.free_count == 0:
            self.wake()
            self.wait_for_room(self, tier)
        while pool.free_count == 0:
            victims = self.policy.victims(tier, 1)
            if not victims:
                return None
            self.policy.on_removed(victims[0])
            self._pressure_drop(victims[0])
        slot = pool.alloc()
        marks = self.marks.get(tier)
        if marks is not None and pool.free_count < marks.low:
            self.wake()
        return slot

    def would_demote(self, tier: Tier) -> bool:
        """Would the cleaner copy (rather than drop) the next victim of ``tier``? Only then is a request
        on a full tier worth waiting for it."""
        lower = self._lower(tier)
        victims = self.policy.victims(tier, 1) if lower is not None and tier in self.marks else []
        return bool(victims) and self.policy.admits(victims[0], lower)   # type: ignore[arg-type]

    def ask_cleaning(self, tier: Tier) -> bool:
        """A request found ``tier`` full: if the cleaner could free a slot by copying (``would_demote``),
        mark the tier to clean up to its high mark now, even if no pass has seen it below low yet. False:
        nothing a cleaning pass could free, the drop (or out_of_blocks) comes at once."""
        if not self.would_demote(tier):
            return False
        self.marks[tier].cleaning = True
        return True

    def _pressure_drop(self, rec: BlockRecord) -> None:
        lower = self._lower(rec.tier)
        if lower is not None:
            self.counters["pressure_drops" if self.policy.admits(rec, lower) else "admission_rejects"] += 1
        else:
            self._count_unpaid(rec.tier)
        self.drop(rec)

    def _count_unpaid(self, tier: Tier) -> None:
        """A victim of ``tier`` dropped because the NVMe tier below it does not pay (``nvme_pays``)."""
        if self._next(tier) is Tier.NVME and not self.nvme_degraded:
            self.counters["nvme_unpaid_drops"] += 1

    # --- background demotion (kvd/demotion.py has the protocol) -----------------------------------
    def clean_want(self, tier: Tier) -> int:
        """Slots the cleaner should free in ``tier`` now (0 for a tier with nothing below it)."""
        marks = self.marks.get(tier)
        if marks is None or self._lower(tier) is None:
            return 0
        return marks.want(self.pools[tier].free_count + self.inflight[tier])   # in flight = freed soon

    def plan_demotions(self, tier: Tier, n: int) -> list[Demotion]:
        """Under kvd's lock: free up to ``n`` slots of ``tier``. Victims the lower tier refuses are dropped
        now (no copy); the others get a reserved destination slot and are marked ``demoting``."""
        lower = self._lower(tier)
        jobs: list[Demotion] = []
        freed = 0
        while lower is not None and freed < n:
            victims = self.policy.victims(tier, 1)
            if not victims:
                break
            rec = victims[0]
            if not self.policy.admits(rec, lower):
                self.policy.on_removed(rec)
                self.counters["admission_rejects"] += 1
                self.drop(rec)
                freed += 1
                continue
            slot = self._reserve(lower)
            if slot is None:
                break   # the lower tier is full of blocks it cannot let go of yet: try again next pass
            self.policy.on_removed(rec)
            rec.demoting = True
            self.inflight[tier] += 1
            jobs.append(Demotion(rec, self.pools[tier], rec.slot, self.pools[lower], slot, rec.sightings))
            freed += 1
        return pair_in_slot_order(jobs)

    def _reserve(self, tier: Tier) -> int | None:
        """A free slot of ``tier`` for a demotion. A full tier makes room by dropping its own victim (no
        copy): the last tier always, a middle tier (DRAM) too, counted as ``spill_drops``. Why a middle
        tier does not wait for its own demotions: those are NVMe writes, ~10x slower than the GPU→DRAM
        copies queued behind them, so waiting chains the GPU tier's reserve (what every allocation needs)
        to NVMe speed; on the H200 that was 15 s of pressure waits in a 47 s agentic run
        (docs/design/kvd.md, "Top-down cleaning"). The middle tier still demotes in the background when the
        tier above is not short of room."""
        pool = self.pools[tier]
        if pool.free_count == 0:
            victims = self.policy.victims(tier, 1)
            if victims:
                self.policy.on_removed(victims[0])
                if self._lower(tier) is not None:
                    self.counters["spill_drops"] += 1
                else:
                    self._count_unpaid(tier)
                self.drop(victims[0])
        return pool.alloc()

    def finish_demotions(self, jobs: list[Demotion], error: BaseException | None, seconds: float) -> None:
        """Under kvd's lock, after the copy: land each move or cancel it (see kvd/demotion.py). The
        caller re-enters the records into the policy."""
        dst = jobs[0].dst
        name = dst.tier.name.lower()
        self.counters[f"demote_{name}_seconds"] += seconds
        self.counters["clean_batches"] += 1
        self.inflight[jobs[0].src.tier] -= len(jobs)
        for job in jobs:
            rec = job.rec
            rec.demoting = False
            if error is None and job.still_wanted() and self.index.get(rec.hash) is rec:
                job.src.free(job.src_slot)
                rec.tier, rec.slot = dst.tier, job.dst_slot
                self.counters["demotions"] += 1
                self.counters[f"demote_{name}_blocks"] += 1
            else:
                dst.free(job.dst_slot)
                self.counters["demote_cancels" if error is None else "demote_errors"] += 1
        if isinstance(error, OSError):
            self._degrade(dst.tier, error)
        elif error is not None:
            log.warning("group %s: a demotion batch to %s failed (%s); blocks kept where they were", self.name,
                        name, error)

    def _next(self, tier: Tier) -> Tier | None:
        tiers = list(self.pools)
        i = tiers.index(tier) + 1
        return tiers[i] if i < len(tiers) else None

    def _lower(self, tier: Tier) -> Tier | None:
        """The tier a victim of ``tier`` moves to: the next configured one, unless that is an NVMe tier that is
        degraded or does not pay (``nvme_pays``)."""
        lower = self._next(tier)
        if lower is Tier.NVME and (self.nvme_degraded or not self.nvme_pays()):
            return None
        return lower

    def nvme_pays(self) -> bool:
        """Is a block worth writing to NVMe: would promoting it back (the measured NVMe rate, kvd/tier_rates.py)
        cost less than the client recomputing it (the price its lookups carry)? Until a lookup has named a
        price, yes.

        It decides for whichever tier sits above NVMe (DRAM, or the GPU tier where there is no DRAM).

        Why: the prefetch budget (kvd/prefetch_budget.py) recomputes rather than promote a block that costs
        more, and the reuse policy demotes chains' leaves first, so such blocks would sit on NVMe unread while
        their writes take the cleaner's time. On the H200 with a Qwen3-8B-shaped model (2.36 MB blocks, run
        BJ): NVMe promoted at 1.2 GB/s (2.0 ms a block) against 0.35 ms to recompute one; the 1,812 blocks
        written took 10.4 s of the cleaner (0.41 GB/s), its GPU-tier reserve waited 2.8 s against lru-offload's
        1.5 s, and `ours` read 59.5% of prompt tokens from cache against lru-offload's 66.0%. DRAM is never
        skipped: its copies (~0.1 ms a block there) overlap the prefill and cost a fraction of recomputing."""
        if not self.skip_unpaid_nvme or self.recompute_s is None:
            return True
        return self.promote_s(Tier.NVME, self.block_bytes) <= self.recompute_s

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

    def start_promotion(self, rec: BlockRecord, now: float) -> Promotion | None:
        """Reserve a GPU slot for a leased lower-tier block; the caller queues it in its lease's batch."""
        slot = self.free_slot(Tier.GPU, now)
        if slot is None:
            return None
        rec.moving, rec.dest = True, slot
        return Promotion(rec, self.pools[rec.tier], rec.slot, slot)

    def finish_promotion(self, p: Promotion) -> None:
        """Under kvd's lock, after the batch's copies: the block is on the GPU now, or (its copy failed)
        dropped, so its reserved slot, which holds no valid bytes, is never served."""
        rec = p.rec
        rec.moving = False
        p.src.free(p.src_slot)
        if p.error is not None:
            log.warning("group %s: promotion of %s failed (%s); block dropped", self.name, rec.hash.hex(), p.error)
            self.gpu.free(p.dst_slot)
            self.index.remove(rec.hash)
            self.counters["promotion_errors"] += 1
            return
        rec.tier, rec.slot, rec.dest = Tier.GPU, p.dst_slot, -1
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


def pair_in_slot_order(jobs: list[Demotion]) -> list[Demotion]:
    """Re-pair a batch's reserved destination slots (interchangeable: all free, all reserved) with its
    sources in source-slot order, both ascending. Why: victims come in policy order (``reuse`` scores
    interleave sessions), so pairing each with the slot reserved for it scattered a chain that was
    adjacent on the GPU; pairing in slot order lands it adjacent in DRAM, so this copy and the chain's
    later promotion are a few runs (kvd/tiers/base.py ``copy_runs``) instead of one copy per block. On
    the H200, ``reuse`` promoted from DRAM at 5-6 GB/s against LRU's 10.5 (docs/results/kv.md).
    The list keeps the policy's order (records re-enter the lower tier's policy in it when they land);
    ``Demotion.run_batch`` copies in source-slot order."""
    dst = sorted(j.dst_slot for j in jobs)
    for j, slot in zip(sorted(jobs, key=lambda j: j.src_slot), dst):
        j.dst_slot = slot
    return jobs
