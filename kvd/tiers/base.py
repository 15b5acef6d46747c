"""One interface for the three tiers: a fixed number of block-sized slots.

A pool never decides what to keep (that is kvd/eviction's job) and never knows about hashes except
the NVMe pool, which must persist them. Every block is one contiguous ``[block_bytes]`` uint8 object,
so a tier move is a single copy (DESIGN.md §3: never one small tensor at a time).
"""
from __future__ import annotations

import errno
import heapq
import os
from abc import ABC, abstractmethod
from dataclasses import dataclass
from pathlib import Path

import torch

from kvd.tiers import pool_files
from kvd.types import BlockHash, Tier


@dataclass(frozen=True)
class BlockMeta:
    """What the NVMe index persists with a block, so a restart can rebuild the index."""

    hash: BlockHash
    parent: BlockHash | None
    depth: int


class BlockPool(ABC):
    """``blocks`` slots of ``block_bytes`` bytes; the free slots are a min-heap: ``alloc`` hands out the
    lowest free slot. Why not a LIFO list: tier copies go as runs of slots adjacent on both sides
    (kvd/tiers/base.py ``copy_runs``, kvd/promotion.py), and a LIFO list hands a batch of slots freed in
    ascending order back descending, so a demoted chain landed one block per copy; lowest-first keeps a
    batch's destination slots ascending wherever the free space is contiguous."""

    tier: Tier

    def __init__(self, blocks: int, block_bytes: int) -> None:
        self.blocks = blocks
        self.block_bytes = block_bytes
        self._free = list(range(blocks))   # a sorted list is a valid min-heap

    @property
    def free_count(self) -> int:
        return len(self._free)

    @property
    def used_count(self) -> int:
        return self.blocks - len(self._free)

    def alloc(self) -> int | None:
        return heapq.heappop(self._free) if self._free else None

    def free(self, slot: int) -> None:
        heapq.heappush(self._free, slot)

    def claim(self, slots: set[int]) -> None:
        """Mark ``slots`` used (recovery of persisted entries)."""
        self._free = [s for s in self._free if s not in slots]
        heapq.heapify(self._free)

    @abstractmethod
    def read_into(self, slot: int, dst: torch.Tensor) -> None:
        """Copy the block at ``slot`` into ``dst`` ([block_bytes] uint8, any device)."""

    @abstractmethod
    def write_from(self, slot: int, src: torch.Tensor, meta: BlockMeta) -> None:
        """Store ``src`` ([block_bytes] uint8) at ``slot``."""

    def close(self) -> None:
        """Release OS resources; a clean shutdown."""


class MemoryPool(BlockPool):
    """A pool backed by one ``[blocks, block_bytes]`` uint8 tensor (shared file or CUDA memory)."""

    def __init__(self, tier: Tier, tensor: torch.Tensor, path: Path | None) -> None:
        super().__init__(tensor.shape[0], tensor.shape[1])
        self.tier = tier
        self.tensor = tensor  # [blocks, block_bytes] uint8
        self.path = path
        self._lock_fd = pool_files.hold(path) if path is not None else None   # ownership: kvd/tiers/pool_files.py

    def view(self, slot: int) -> torch.Tensor:
        return self.tensor[slot]  # [block_bytes]

    def read_into(self, slot: int, dst: torch.Tensor) -> None:
        _copy(dst, self.tensor[slot])

    def write_from(self, slot: int, src: torch.Tensor, meta: BlockMeta) -> None:
        _copy(self.tensor[slot], src)

    def close(self) -> None:
        if self.path is not None:
            try:
                self.path.unlink()
            except FileNotFoundError:
                pass
        if self._lock_fd is not None:
            os.close(self._lock_fd)
            self._lock_fd = None


def copy_runs(dst: torch.Tensor, dst_slots: list[int], src: torch.Tensor, src_slots: list[int]) -> None:
    """Copy rows ``src[src_slots[i]]`` to ``dst[dst_slots[i]]`` (both ``[blocks, block_bytes]``), one copy per
    run of slots that are consecutive on both sides, with one stream wait at the end. Why: on the H200 one
    192 KiB block copies at 11 GB/s, one large transfer at 53 GB/s (docs/results/kv.md); the cleaner
    reserves destination slots in order, so runs are common."""
    queue_runs(dst, dst_slots, src, src_slots)
    wait_stream(dst, src)


def queue_runs(dst: torch.Tensor, dst_slots: list[int], src: torch.Tensor, src_slots: list[int]) -> int:
    """``copy_runs`` without the wait: a copy touching the GPU is only queued on the current stream, so a
    caller with several sources (kvd/promotion.py) waits once for all of them. Returns the copies issued.

    Between host and GPU, every run goes in one ``torch._foreach_copy_`` call: one trip out of and back into
    the GIL for the batch instead of one per copy. Why (session 24): in served runs 60-80% of a promotion's copy time was
    spent issuing its ~46 copies, and on the H200 46 copies of 7 blocks (760 MB) issued one by one took 547 ms
    beside a thread keeping the GIL busy, against 14 ms alone; as one foreach call, 72-236 ms at Python's
    default switch interval and 14.9 ms (51 GB/s) at 0.5 ms (``KvdConfig.gil_switch_ms``;
    docs/design/kvd.md, "The GIL in the copy path"). ``queue_runs_reference`` is the per-run loop."""
    runs = slot_runs(dst_slots, src_slots)
    # between host and GPU, both directions (promotions and the cleaner's demotions); checked on the H200, bytes
    # equal (tests/kvd/test_batched_copy.py): GPU to DRAM, 46 copies of 7 blocks beside a GIL-busy thread at
    # 0.5 ms took 33.5 ms one by one and 14.6 ms (52 GB/s) batched (session 25)
    if dst.is_cuda != src.is_cuda and len(runs) >= 2:
        return queue_batched(dst, src, runs, non_blocking=True)
    return queue_each(dst, src, runs, non_blocking=dst.is_cuda or src.is_cuda)


def queue_batched(dst: torch.Tensor, src: torch.Tensor, runs: list[tuple[int, int, int]],
                  non_blocking: bool = False) -> int:
    """Copy ``src[s:s+n]`` to ``dst[d:d+n]`` for every ``(d, s, n)`` of ``runs`` in one foreach call."""
    torch._foreach_copy_([dst[d : d + n] for d, _, n in runs], [src[s : s + n] for _, s, n in runs],
                         non_blocking=non_blocking)
    return len(runs)


def queue_each(dst: torch.Tensor, src: torch.Tensor, runs: list[tuple[int, int, int]],
               non_blocking: bool = False) -> int:
    """One ``copy_`` per ``(d, s, n)`` of ``runs``."""
    for d, s, n in runs:
        dst[d : d + n].copy_(src[s : s + n], non_blocking=non_blocking)
    return len(runs)


def queue_runs_reference(dst: torch.Tensor, dst_slots: list[int], src: torch.Tensor, src_slots: list[int]) -> int:
    """One ``copy_`` per run of slots (the reference of ``queue_runs``; its path for CPU-only copies)."""
    return queue_each(dst, src, slot_runs(dst_slots, src_slots), non_blocking=dst.is_cuda or src.is_cuda)


def wait_stream(dst: torch.Tensor, src: torch.Tensor | None = None) -> None:
    """Wait for the calling thread's current stream on the GPU side of a copy (nothing on the CPU)."""
    dev = dst if dst.is_cuda else src
    if dev is not None and dev.is_cuda:
        torch.cuda.current_stream(dev.device).synchronize()


def slot_runs(a: list[int], b: list[int]) -> list[tuple[int, int, int]]:
    """Maximal runs ``(a0, b0, n)`` where ``a[i..i+n)`` and ``b[i..i+n)`` both count up by one."""
    runs: list[tuple[int, int, int]] = []
    for x, y in zip(a, b):
        if runs and runs[-1][0] + runs[-1][2] == x and runs[-1][1] + runs[-1][2] == y:
            runs[-1] = (runs[-1][0], runs[-1][1], runs[-1][2] + 1)
        else:
            runs.append((x, y, 1))
    return runs


def _copy(dst: torch.Tensor, src: torch.Tensor) -> None:
    """One block copy. A copy that touches the GPU is queued on the calling thread's current stream
    (kvd's mover threads each own a side stream, kvd/mover.py) and waited for on that stream only,
    so it overlaps whatever else the GPU runs; pinned DRAM makes it a true DMA."""
    if dst.is_cuda or src.is_cuda:
        dst.copy_(src, non_blocking=True)
        torch.cuda.current_stream(dst.device if dst.is_cuda else src.device).synchronize()
    else:
        dst.copy_(src)


def shm_dir(run_dir: Path) -> Path:
    """/dev/shm where it exists (tmpfs, so mapping it is shared memory), else the run dir."""
    d = Path("/dev/shm")
    return d if d.is_dir() and os.access(d, os.W_OK) else run_dir


def reserve_file(path: Path, nbytes: int) -> None:
    """Back every byte of ``path`` now, or raise OSError (ENOSPC) and remove it.

    Why: a tmpfs file is sparse, so mapping more than /dev/shm can hold succeeds and the first write
    past the limit kills the process with SIGBUS, long after start-up. Checking the free space first
    refuses an impossible pool without touching memory; fallocate then commits the pages."""
    st = os.statvfs(path.parent)
    if st.f_bavail * st.f_frsize < nbytes:
        raise OSError(errno.ENOSPC, f"{path.parent} has {st.f_bavail * st.f_frsize} bytes free, pool needs {nbytes}")
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        os.posix_fallocate(fd, 0, nbytes)
    except OSError:
        path.unlink(missing_ok=True)
        raise
    finally:
        os.close(fd)


def shm_tensor(path: Path, blocks: int, block_bytes: int, reserve: bool = False) -> torch.Tensor:
    """A ``[blocks, block_bytes]`` uint8 tensor mapped from ``path`` (created, zero-filled, shared),
    so another process can map the same bytes with ``torch.from_file(path, shared=True)``.
    ``reserve``: back the whole file first (``reserve_file``); raises OSError if it cannot be."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.unlink(missing_ok=True)  # a stale pool from a crashed run must not leak old bytes
    nbytes = blocks * block_bytes
    if reserve:
        reserve_file(path, nbytes)
    t = torch.from_file(str(path), shared=True, size=nbytes, dtype=torch.uint8)
    return t.view(blocks, block_bytes)
