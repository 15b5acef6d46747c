"""Where the engine's KV blocks come from.

``LocalBlockSource`` owns a private pool and caches nothing (the ``standard`` baseline, and the
fallback while kvd is unreachable). ``KvdBlockSource`` (specd/engine/kvd_source.py) leases blocks from
kvd's shared pool by prefix hash. The engine sees one interface, so the cache is an option, never a
code path of its own.
"""
from __future__ import annotations

from typing import Protocol, Sequence

import torch

from kvd.types import BlockHash, BlockId, LeaseId


class OutOfBlocks(Exception):
    """No free block right now; the scheduler waits (or preempts) and retries."""


class BlockSource(Protocol):
    pool: torch.Tensor          # [num_blocks, block_bytes] uint8, on the engine's device
    num_blocks: int

    @property
    def connected(self) -> bool: ...
    def lookup(self, hashes: Sequence[BlockHash], session: str | None = None) -> tuple[LeaseId | None, list[BlockId]]: ...
    def allocate(self, n: int) -> tuple[LeaseId, list[BlockId]]: ...
    def commit(self, lease: LeaseId, entries: Sequence[tuple[BlockId, BlockHash, BlockHash | None]]
               ) -> list[BlockId] | None:
        """Publish; returns the canonical block per entry (another id when the hash was already
        published: the caller's block is then freed), or None when nothing was published."""
    def release(self, leases: Sequence[LeaseId], hints: dict | None = None) -> None: ...
    def num_free(self) -> int: ...
    def heartbeat(self) -> None: ...


class LocalBlockSource:
    """A private pool with a free list; ``lookup`` never hits, ``commit`` publishes nothing."""

    def __init__(self, num_blocks: int, block_bytes: int, device: torch.device):
        self.pool = torch.zeros(num_blocks, block_bytes, dtype=torch.uint8, device=device)
        self.num_blocks = num_blocks
        self._free: list[BlockId] = [BlockId(i) for i in reversed(range(num_blocks))]
        self._leases: dict[LeaseId, list[BlockId]] = {}
        self._next_lease = 1

    @property
    def connected(self) -> bool:
        return False

    def lookup(self, hashes, session=None):
        return None, []

    def allocate(self, n: int) -> tuple[LeaseId, list[BlockId]]:
        if n > len(self._free):
            raise OutOfBlocks(f"need {n} blocks, {len(self._free)} free")
        blocks = [self._free.pop() for _ in range(n)]
        lease = LeaseId(self._next_lease)
        self._next_lease += 1
        self._leases[lease] = blocks
        return lease, blocks

    def commit(self, lease, entries) -> None:
        return None

    def release(self, leases, hints=None) -> None:
        for lease in leases:
            self._free.extend(reversed(self._leases.pop(lease, [])))

    def num_free(self) -> int:
        return len(self._free)

    def heartbeat(self) -> None:
        pass
