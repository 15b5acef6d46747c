"""Block bookkeeping for a model with several cache groups (full-attention + sliding-window layers).

Each group has its own pool and block table; all tables of a sequence grow in lockstep (entry i of
every table is token block i). The primary group's table lives in the Sequence as for a full-attention
model; the other groups' tables live here, one ``GroupSeq`` per sequence, each run by a plain
BlockManager bound to its group, so reserve, commit, duplicate handling and release are the code the
full-attention path already uses.

A prefix hit is one joint kvd lookup (``lookup_groups``): the longest end every group can serve. A
sliding group gets only the trailing blocks its window needs behind that end; the entries before them
are *fillers* (the first hit block's id): the attention kernels never read keys outside the window
(the Triton kernel skips those tiles, the reference masks them, and every pool byte is finite KV or
zero), so a filler is never used. Blocks are committed to every group in chain order; kvd drops a
sliding block once the chain has passed its window (kvd/core.py ``_pass_ancestor``), so out-of-window
blocks are never kept once no lease holds them. A running sequence gives its own blocks behind the
window back after each commit (``_drop_behind_window``), so its sliding group's working set stays at
about W/bs blocks however long it grows.
"""
from __future__ import annotations

from kvd.types import BlockHash, BlockId, LeaseId
from specd.engine.block_manager import BlockManager
from specd.engine.block_source import BlockSource
from specd.engine.kv_layout import KVLayout
from specd.engine.sequence import Sequence


class GroupSource:
    """A BlockSource seen through one group: what a per-group BlockManager calls."""

    def __init__(self, source: BlockSource, group: str):
        self.source = source
        self.group = group
        self.pool = source.pools[group]
        self.num_blocks = self.pool.shape[0]

    @property
    def connected(self) -> bool:
        return self.source.connected

    def allocate(self, n: int) -> tuple[LeaseId, list[BlockId]]:
        return self.source.allocate(n, self.group)

    def commit(self, lease, entries):
        return self.source.commit(lease, entries)

    def release(self, leases, hints=None) -> None:
        self.source.release(leases, hints)

    def release_blocks(self, lease, blocks) -> None:
        self.source.release_blocks(lease, blocks)


class GroupSeq:
    """A sequence's table in a secondary group; token state is read from the sequence itself."""

    def __init__(self, seq: Sequence):
        self.seq = seq
        self.block_table: list[BlockId] = []
        self.block_leases: list[LeaseId | None] = []
        self.leases: list[LeaseId] = []
        self.num_hit_blocks = 0
        self.num_committed_blocks = 0
        self.num_dropped = 0          # leading table entries given back (behind the window): fillers now

    @property
    def hashes(self) -> list[BlockHash]:
        return self.seq.hashes

    @property
    def all_ids(self) -> list[int]:
        return self.seq.all_ids

    def ids(self, start: int, end: int) -> list[int]:
        return self.seq.ids(start, end)

    @property
    def num_tokens(self) -> int:
        return self.seq.num_tokens

    @property
    def num_computed_tokens(self) -> int:
        return self.seq.num_computed_tokens


class HybridBlockManager(BlockManager):
    """BlockManager for the primary group plus one per secondary group (same interface)."""

    def __init__(self, source: BlockSource, layout: KVLayout, root: BlockHash, reserve: int = 8):
        super().__init__(source, layout.block_size, root, reserve)
        groups = layout.groups()
        self.primary = groups[0].name
        self.others = {g.name: BlockManager(GroupSource(source, g.name), layout.block_size, root, reserve)
                       for g in groups[1:]}
        self.windows = {g.name: g.window for g in groups[1:]}
        self._gseqs: dict[int, dict[str, GroupSeq]] = {}

    def group_seqs(self, seq: Sequence) -> dict[str, GroupSeq]:
        got = self._gseqs.get(id(seq))
        if got is None:
            got = self._gseqs[id(seq)] = {g: GroupSeq(seq) for g in self.others}
        return got

    def tables(self, seq: Sequence) -> dict[str, list[BlockId]]:
        """Every group's block table of ``seq`` (the primary's is ``seq.block_table``)."""
        return {self.primary: seq.block_table, **{g: s.block_table for g, s in self.group_seqs(seq).items()}}

    # -- prefix match ----------------------------------------------------------------------
    def match_prefix(self, seq: Sequence) -> int:
        self.extend_hashes(seq)
        usable = (len(seq.prompt_ids) - 1) // self.block_size
        if usable == 0 or not self.source.connected:
            return 0
        hit, per_group = self.source.lookup_groups(seq.hashes[:usable], seq.request.session)
        if hit == 0:
            return 0
        lease, _, hits = per_group[self.primary]
        seq.leases.append(lease)
        seq.block_table.extend(hits)
        seq.block_leases.extend([None] * hit)
        for g, gs in self.group_seqs(seq).items():
            lease, first, ids = per_group[g]
            gs.leases.append(lease)
            gs.block_table.extend([ids[0]] * first + ids)      # fillers before the window (never read)
            gs.block_leases.extend([None] * hit)
            gs.num_committed_blocks = gs.num_hit_blocks = hit
        seq.num_committed_blocks = seq.num_hit_blocks = hit
        seq.num_cached_tokens = seq.num_computed_tokens = hit * self.block_size
        return seq.num_cached_tokens

    def match_prefixes(self, seqs: list[Sequence]) -> None:
        """One joint lookup each (kvd's ``lookup_groups`` is not batched here)."""
        for seq in seqs:
            self.match_prefix(seq)

    def hit_leases(self, seq: Sequence) -> list[LeaseId]:
        return [*seq.leases, *(lease for gs in self.group_seqs(seq).values() for lease in gs.leases)]

    # -- growth, commit, free --------------------------------------------------------------
    def ensure_slots(self, seq: Sequence, new_tokens: int) -> None:
        """Secondary groups first: if the primary then runs out, the others only hold a few blocks
        ahead of need (harmless, given back at free), and the sequence's state is unchanged."""
        for g, gs in self.group_seqs(seq).items():
            self.others[g].ensure_slots(gs, new_tokens)       # type: ignore[arg-type]
        super().ensure_slots(seq, new_tokens)

    def may_commit(self, seq: Sequence) -> bool:
        """Always: a sliding-window group gives back blocks behind the window as the sequence grows,
        also at steps that fill no block (``_drop_behind_window``)."""
        return True

    def commit_full(self, seq: Sequence) -> None:
        super().commit_full(seq)
        for g, gs in self.group_seqs(seq).items():
            self.others[g].commit_full(gs)                     # type: ignore[arg-type]
            if self.windows[g] is not None:
                self._drop_behind_window(g, gs)

    def _drop_behind_window(self, g: str, gs: GroupSeq) -> None:
        """Give back the blocks no future query of this sequence can see: every query sits at a position
        >= num_computed_tokens = n and sees keys > pos - W, so blocks before the one holding key
        n - W + 1 are dead. They are committed already (dead implies full and computed), so the chain
        stays published; the table keeps their ids as fillers (never read)."""
        first_live = max(0, (gs.num_computed_tokens - self.windows[g] + 1) // self.block_size)
        first_live = min(first_live, gs.num_committed_blocks)
        dead = [(gs.block_leases[j], gs.block_table[j]) for j in range(gs.num_dropped, first_live)
                if gs.block_leases[j] is not None]
        for j in range(gs.num_dropped, first_live):
            gs.block_leases[j] = None                          # given back: free() must not count it again
        gs.num_dropped = max(gs.num_dropped, first_live)
        if dead:
            self.others[g].give_back_blocks(dead)              # type: ignore[arg-type]

    def free(self, seq: Sequence, hints: dict | None = None) -> None:
        super().free(seq, hints)
        for g, gs in self._gseqs.pop(id(seq), {}).items():
            self.others[g].free(gs)                            # type: ignore[arg-type]

    def release_reserve(self) -> bool:
        held = super().release_reserve()
        for bm in self.others.values():
            held = bm.release_reserve() or held
        return held
