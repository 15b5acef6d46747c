"""The block index of one cache group: hash -> BlockRecord, and prefix lookup.

Invariant: a record is in the index iff its block's bytes sit in exactly one tier slot
(``tier``, ``slot``), or are being promoted to the GPU slot ``dest`` (``moving``). A record being
demoted by the cleaner (``demoting``) still owns its ``tier``/``slot``; the copy's destination belongs
to the cleaner's job until it lands (kvd/demotion.py). Only the core
(kvd/core.py, kvd/cache_group.py) mutates records; policies read them and keep their own state in
``policy_state``.
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Any, Iterable, Iterator

from kvd.types import BlockHash, BlockKind, Tier

ROOT_LOG = 4096     # root changes kept for delta answers: ~80 s of a zero-hit stream at 50 new prompts/s


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
        self._roots: set[BlockHash] = set()   # first blocks (no parent): a prompt whose block 0 is absent cannot hit
        self.roots_version = 0                # bumped whenever ``_roots`` changes (KvdCore.roots)
        # the last changes, (version after it, hash, added): a client one refresh behind gets these, not the set
        self._root_log: deque[tuple[int, BlockHash, bool]] = deque(maxlen=ROOT_LOG)

    def __len__(self) -> int:
        return len(self._recs)

    def __contains__(self, h: object) -> bool:
        return h in self._recs

    def __iter__(self) -> Iterator[BlockRecord]:
        return iter(list(self._recs.values()))

    def get(self, h: BlockHash) -> BlockRecord | None:
        return self._recs.get(h)

    def roots(self) -> list[BlockHash]:
        """Hashes of the first blocks present (any tier): every prefix hit starts at one of them."""
        return list(self._roots)

    def root_changes(self, since: int) -> tuple[list[BlockHash], list[BlockHash]] | None:
        """(added, removed) first blocks between version ``since`` and now, or None when the log no longer
        reaches back that far (or ``since`` is not a version of this index): send the whole set then."""
        if since == self.roots_version:
            return [], []
        if since > self.roots_version or not self._root_log or self._root_log[0][0] > since + 1:
            return None
        net: dict[BlockHash, bool] = {}
        for version, h, added in reversed(self._root_log):
            if version <= since:
                break
            net.setdefault(h, added)       # the latest change of each hash wins
        return [h for h, a in net.items() if a], [h for h, a in net.items() if not a]

    def _root_changed(self, h: BlockHash, added: bool) -> None:
        if added:
            self._roots.add(h)
        else:
            self._roots.discard(h)
        self.roots_version += 1
        self._root_log.append((self.roots_version, h, added))

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
            self._root_changed(rec.hash, True)
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
        if rec.parent is None:
            self._root_changed(h, False)
        else:
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
