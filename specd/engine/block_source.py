"""Where the engine's KV blocks come from.

``LocalBlockSource`` owns a private pool and caches nothing (the ``standard`` baseline, and the
fallback while kvd is unreachable); ``LocalGroupsSource`` is one of those per cache group, for a model
with sliding-window layers. ``KvdBlockSource`` (specd/engine/kvd_source.py) leases blocks from kvd's
shared pools by prefix hash. The engine sees one interface, so the cache is an option, never a code
path of its own. A source has one pool per cache group (specd/engine/kv_layout.py) in ``pools``;
``pool`` and ``num_blocks`` are the primary group's, and ``group=None`` means the primary group.
"""
from __future__ import annotations

from typing import Protocol, Sequence

import torch

from kvd.types import BlockHash, BlockId, LeaseId
from specd.engine.kv_layout import KVLayout


class OutOfBlocks(Exception):
    """No free block right now; the scheduler waits (or preempts) and retries."""


class BlockSource(Protocol):
    pool: torch.Tensor          # [num_blocks, block_bytes] uint8, on the engine's device (primary group)
    pools: dict[str, torch.Tensor]
    num_blocks: int

    @property
    def connected(self) -> bool: ...
    def lookup(self, hashes: Sequence[BlockHash], session: str | None = None
               ) -> tuple[LeaseId | None, list[BlockId]] | tuple[LeaseId | None, list[BlockId], int]:
        """The leased cached prefix: (lease, block ids), plus, where the source can tell, how many more
        blocks it holds that no GPU slot could take (kvd's ``room_cut``: ask again once room is freed)."""
    def lookup_groups(self, hashes: Sequence[BlockHash], session: str | None = None
                      ) -> tuple[int, dict[str, tuple[LeaseId | None, int, list[BlockId]]]]:
        """A joint hit across groups: (hit blocks, {group: (lease, index of its first hit, ids)})."""
    def landed(self, leases: Sequence[LeaseId]) -> bool | None:
        """Whether the hits of these lookup leases may be read: True (on the GPU), None (a promotion is
        still in flight: ask again after ``poll``), False (never: a promotion failed or kvd is gone;
        release the leases and recompute). A lookup never waits for its promotions."""
    def poll(self) -> None:
        """Take the readiness answers that have arrived, without waiting (once per scheduler step)."""
    def allocate(self, n: int, group: str | None = None) -> tuple[LeaseId, list[BlockId]]: ...
    def commit(self, lease: LeaseId, entries: Sequence[tuple[BlockId, BlockHash, BlockHash | None]]
               ) -> list[BlockId] | None:
        """Publish; returns the canonical block per entry (another id when the hash was already
        published: the caller's block is then freed), or None when nothing was published. A source
        with ``defers_commits`` also takes ``on_done=``: it then returns None at once and calls
        ``on_done(canonical or None)`` from ``settle()``."""
    def settle(self) -> None:
        """Finish what was sent without waiting (deferred commits, releases); before each forward."""
    def release(self, leases: Sequence[LeaseId], hints: dict | None = None) -> None: ...
    def release_blocks(self, lease: LeaseId, blocks: Sequence[BlockId]) -> None:
        """Give back some blocks of a live allocate lease (the lease stays open)."""
    def num_free(self) -> int: ...
    def heartbeat(self) -> None: ...
    def observe_prefill(self, tokens: int, seconds: float) -> None:
        """One forward step's new tokens and time: the recompute side of kvd's prefetch budget."""
    def stats(self) -> dict[str, float]:
        """Counters of the source for engine.stats() (kvd round trips); empty for a private pool."""


class _NeverHits:
    """What every private pool answers: not connected to a shared cache, so a lookup never hits, and
    there is no kvd to heartbeat, settle with, or report on."""

    pools: dict

    @property
    def connected(self) -> bool:
        return False

    def lookup(self, hashes, session=None):
        return None, []

    def lookup_groups(self, hashes, session=None):
        return 0, {g: (None, 0, []) for g in self.pools}

    def landed(self, leases) -> bool:
        return True

    def poll(self) -> None:
        pass

    def heartbeat(self) -> None:
        pass

    def observe_prefill(self, tokens: int, seconds: float) -> None:
        pass

    def settle(self) -> None:
        pass

    def stats(self) -> dict[str, float]:
        return {}


class LocalBlockSource(_NeverHits):
    """A private pool with a free list; ``lookup`` never hits, ``commit`` publishes nothing."""

    def __init__(self, num_blocks: int, block_bytes: int, device: torch.device, first_lease: int = 1):
        self.pool = torch.zeros(num_blocks, block_bytes, dtype=torch.uint8, device=device)
        self.pools = {"full": self.pool}
        self.num_blocks = num_blocks
        self._free: list[BlockId] = [BlockId(i) for i in reversed(range(num_blocks))]
        self._leases: dict[LeaseId, list[BlockId]] = {}
        self._next_lease = first_lease

    def allocate(self, n: int, group: str | None = None) -> tuple[LeaseId, list[BlockId]]:
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

    def release_blocks(self, lease: LeaseId, blocks: Sequence[BlockId]) -> None:
        for b in blocks:
            self._leases[lease].remove(b)
            self._free.append(b)

    def num_free(self) -> int:
        return len(self._free)


LEASE_SPAN = 1 << 40   # lease ids of the groups of a LocalGroupsSource never collide


class LocalGroupsSource(_NeverHits):
    """One private LocalBlockSource per cache group (a hybrid model served without kvd)."""

    def __init__(self, num_blocks: int, layout: KVLayout, device: torch.device):
        self.parts = {g.name: LocalBlockSource(num_blocks, g.layout.block_bytes, device, 1 + i * LEASE_SPAN)
                      for i, g in enumerate(layout.groups())}
        self.primary = next(iter(self.parts))
        self.pools = {g: p.pool for g, p in self.parts.items()}
        self.pool = self.pools[self.primary]
        self.num_blocks = num_blocks

    def allocate(self, n: int, group: str | None = None) -> tuple[LeaseId, list[BlockId]]:
        return self.parts[group or self.primary].allocate(n)

    def commit(self, lease, entries) -> None:
        return None

    def release(self, leases, hints=None) -> None:
        for lease in leases:
            self.parts_of(lease).release([lease])

    def release_blocks(self, lease: LeaseId, blocks: Sequence[BlockId]) -> None:
        self.parts_of(lease).release_blocks(lease, blocks)

    def parts_of(self, lease: LeaseId) -> LocalBlockSource:
        return list(self.parts.values())[(lease - 1) // LEASE_SPAN]

    def num_free(self) -> int:
        return self.parts[self.primary].num_free()


def local_source(num_blocks: int, layout: KVLayout, device: torch.device) -> LocalBlockSource | LocalGroupsSource:
    """Private pools for ``layout``: one (a full-attention model) or one per cache group."""
    if layout.hybrid:
        return LocalGroupsSource(num_blocks, layout, device)
    return LocalBlockSource(num_blocks, layout.block_bytes, device)
