"""One lease's promotions as one batch: the mover's unit of work (kvd/mover.py runs it).

Why a batch and not one job per block: measured on the H200 (32 agent sessions, 192 KiB blocks), a
parked request waited ~1 ms per promoted block against 17 µs for the copy itself: each block was its
own job with its own copy, stream synchronize and trip through kvd's lock (docs/design/kvd.md,
"Promotions"). A batch copies DRAM sources as runs of adjacent slots, reads NVMe sources into one
pinned host staging buffer and sends it to the GPU pool in one transfer per destination run, waits
for the stream once, and is finished under the lock once.

Protocol (as for demotions, kvd/demotion.py):
1. under kvd's lock, ``CacheGroup.start_promotion`` reserves a GPU slot per block and marks it ``moving``;
2. without the lock, ``PromotionBatch.run`` copies; a failed NVMe read fails only its own block, a failed
   transfer fails every block it carried (their bytes cannot be trusted), recorded in ``Promotion.error``;
3. under the lock again, the core calls ``CacheGroup.finish_promotion`` for every block: a landed one
   moves to the GPU tier, a failed one is dropped (its reserved slot never served).
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from kvd.block_index import BlockRecord
from kvd.tiers import BlockPool, MemoryPool
from kvd.tiers.base import queue_runs, wait_stream
from kvd.types import Tier


@dataclass(eq=False)
class Promotion:
    """One block of a batch: its source slot and reserved GPU destination slot."""

    rec: BlockRecord
    src: BlockPool
    src_slot: int
    dst_slot: int
    error: BaseException | None = None


@dataclass(eq=False)
class PromotionBatch:
    group: str
    dst: MemoryPool                       # the group's GPU pool
    items: list[Promotion]
    seconds: dict[Tier, float] = field(default_factory=dict)   # per source tier, for kvd/tier_rates.py
    predicted_s: float = 0.0              # the copy time priced when queued (the core's promotion backlog)
    submitted_at: float = 0.0             # perf_counter when queued (Mover.submit)
    queue_s: float = 0.0                  # from queued to started: waiting behind other batches
    copy_s: float = 0.0                   # ``run`` itself: reads, transfers and the stream wait
    issue_s: float = 0.0                  # of it, the reads and queueing the transfers (CPU, GIL): before the wait
    copies: int = 0                       # transfers queued (one per run of adjacent slots)

    def run(self) -> None:
        """Copy every block; never raises (each failure lands in its items' ``error``)."""
        t0 = time.perf_counter()
        mem = [p for p in self.items if isinstance(p.src, MemoryPool)]
        disk = [p for p in self.items if not isinstance(p.src, MemoryPool)]
        staged, staging = _read_staged(disk)   # the slow part first: CPU-bound reads, no stream work yet
        t_read = time.perf_counter() - t0
        try:
            for src, ps in _by_pool(mem):
                self.copies += queue_runs(self.dst.tensor, [p.dst_slot for p in ps], src.tensor,
                                          [p.src_slot for p in ps])
            if staged:
                self.copies += queue_runs(self.dst.tensor, [p.dst_slot for p in staged], staging,
                                          list(range(len(staged))))
            self.issue_s = time.perf_counter() - t0
            wait_stream(self.dst.tensor, staging if staged else None)
        except Exception as e:  # noqa: BLE001 - the transfer's blocks are unknown: fail all it carried
            for p in mem + staged:
                p.error = e
        self._time(t_read, time.perf_counter() - t0, mem, disk)

    def _time(self, t_read: float, total: float, mem: list[Promotion], disk: list[Promotion]) -> None:
        """Seconds per source tier: NVMe pays its reads, and the shared transfer phase is split by bytes."""
        n_mem = sum(1 for p in mem if p.error is None)
        n_disk = sum(1 for p in disk if p.error is None)
        share = n_mem / (n_mem + n_disk) if n_mem + n_disk else 0.0
        transfer = total - t_read
        if n_mem:
            self.seconds[mem[0].src.tier] = transfer * share
        if n_disk:
            self.seconds[Tier.NVME] = t_read + transfer * (1 - share)

    def fail_unfinished(self, error: BaseException) -> None:
        """``run`` itself raised: no block of the batch is known to have landed."""
        for p in self.items:
            p.error = p.error or error

    def landed_bytes(self, tier: Tier) -> int:
        return sum(self.dst.block_bytes for p in self.items if p.error is None and p.src.tier == tier)


def pair_slots(items: list[Promotion]) -> None:
    """Under kvd's lock, before the batch is queued: hand the reserved GPU slots out in source-slot order.
    Which reserved slot a block gets does not matter, but the GPU free list is LIFO, so slots come back in
    the reverse of the order the cleaner freed them: paired as reserved, a run of source slots met a
    descending run of destinations and every block became its own copy (512 copies for 512 blocks, measured).
    Sorted on both sides, a run of source slots meets a run of destinations: one copy per run."""
    dst = sorted(p.dst_slot for p in items)
    items.sort(key=lambda p: (p.src.tier, p.src_slot))   # the batch copies in this order
    for p, d in zip(items, dst):
        p.dst_slot = p.rec.dest = d


def _by_pool(items: list[Promotion]) -> list[tuple[MemoryPool, list[Promotion]]]:
    pools: dict[int, tuple[MemoryPool, list[Promotion]]] = {}
    for p in items:
        pools.setdefault(id(p.src), (p.src, []))[1].append(p)   # type: ignore[arg-type]
    return list(pools.values())


def _read_staged(disk: list[Promotion]) -> tuple[list[Promotion], torch.Tensor]:
    """Read NVMe blocks into one host staging buffer ([n, block_bytes] uint8, pinned when CUDA exists, so
    the transfer to the GPU is one DMA per destination run). Returns the blocks read, in staging-row order;
    a block whose read failed gets its error and no row."""
    if not disk:
        return [], torch.empty(0, dtype=torch.uint8)
    bb = disk[0].src.block_bytes
    staging = torch.empty((len(disk), bb), dtype=torch.uint8, pin_memory=torch.cuda.is_available())
    ok: list[Promotion] = []
    for p in disk:
        try:
            p.src.read_into(p.src_slot, staging[len(ok)])
        except Exception as e:  # noqa: BLE001 - this block only
            p.error = e
            continue
        ok.append(p)
    return ok, staging[: len(ok)]
