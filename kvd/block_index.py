"""The block index of one cache group: hash -> BlockRecord, and prefix lookup.

Invariant: a record is in the index iff its block's bytes sit in exactly one tier slot
(``tier``, ``slot``), or are being promoted to the GPU slot ``dest`` (``moving``). A record being
demoted by the cleaner (``demoting``) still owns its ``tier``/``slot``; the copy's destination belongs
to the cleaner's job until it lands (kvd/demotion.py). Only the core
(kvd/core.py, kvd/cache_group.py) mutates records; policies read them and keep their own state in
``policy_state``.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Iterable, Iterator

from kvd.types import BlockHash, BlockKind, Tier


@dataclass(slots=True, eq=False)
class BlockRecord:
    hash: BlockHash
    parent: BlockHash | None
    depth: int  # 0 for a first block; recompute cost grows with it
    tier: Tier
    slot: int  # slot in ``tier``'s pool
    children: int = 0  # children present in the index (any tier); 0 -> a leaf
    count: float = 1.0  # decayed access count (kvd.temperature), as of t_last
    t_last: float = 0.0
    sightings: int = 1  # raw accesses (commit + lookup hits); the admission gate reads it
    refs: int = 0  # live leases holding the block; > 0 -> never moved or evicted
    pinned: bool = False  # admin pin; never evicted
    moving: bool = False  # a promotion to the GPU slot ``dest`` is in flight
    dest: int = -1
    demoting: bool = False  # the cleaner is copying it one tier down; its slot must not be freed meanwhile
    kind: BlockKind = BlockKind.UNKNOWN
    session: str | None = None
    protect_until: float = 0.0  # live-session tail: expected back before this time
    tail: bool = False  # last block of a released lease, no children yet
    superseded: bool = False  # a sibling branch was committed after it, it was never reused
    last_child: BlockHash | None = None  # the most recently committed child
    passed: bool = False  # tail group: out of the window of every end that needs it; dropped when unleased
    policy_state: Any = field(default=None)

    @property
    def evictable(self) -> bool:
        """May a policy pick it: not leased, not pinned, not mid-move (either direction)."""
        return self.refs == 0 and not self.pinned and not self.moving and not self.demoting


class BlockIndex:
    """hash -> record for one cache group; keeps child counts consistent in O(1).

    Children whose parent is absent (dropped, or not yet recovered from NVMe) are counted in
    ``_orphans`` so a re-committed parent starts with the right count."""

    def __init__(self) -> None:
        self._recs: dict[BlockHash, BlockRecord] = {}
        self._orphans: dict[BlockHash, int] = {}  # absent parent hash -> present children

    def __len__(self) -> int:
        return len(self._recs)

    def __contains__(self, h: object) -> bool:
        return h in self._recs

    def __iter__(self) -> Iterator[BlockRecord]:
        return iter(list(self._recs.values()))

    def get(self, h: BlockHash) -> BlockRecord | None:
        return self._recs.get(h)

    def prefix(self, hashes: Iterable[BlockHash]) -> list[BlockRecord]:
        """Records of the longest contiguous present prefix of ``hashes``; stops at the first gap.

        A later block present without its predecessor is useless (its KV attends to the missing
        one), so it never counts."""
        out: list[BlockRecord] = []
        for h in hashes:
            rec = self._recs.get(h)
            if rec is None:
                break
            out.append(rec)
        return out

    def insert(self, rec: BlockRecord) -> None:
        """Add a new record; its parent (present or not) gains a child."""
        assert rec.hash not in self._recs, "insert of a present hash"
        self._recs[rec.hash] = rec
        rec.children = self._orphans.pop(rec.hash, 0)
        if rec.parent is None:
            return
        parent = self._recs.get(rec.parent)
        if parent is not None:
            parent.children += 1
        else:
            self._orphans[rec.parent] = self._orphans.get(rec.parent, 0) + 1

    def remove(self, h: BlockHash) -> BlockRecord:
        """Drop a record; its parent loses a child. Its own children stay (unreachable by prefix
        lookup until the parent is committed again)."""
        rec = self._recs.pop(h)
        if rec.children:
            self._orphans[h] = rec.children
        if rec.parent is not None:
            parent = self._recs.get(rec.parent)
            if parent is not None:
                parent.children -= 1
            else:
                left = self._orphans[rec.parent] - 1
                if left:
                    self._orphans[rec.parent] = left
                else:
                    del self._orphans[rec.parent]
        return rec
