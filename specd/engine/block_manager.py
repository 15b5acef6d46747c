"""Per-sequence block bookkeeping on top of a BlockSource: prefix match, slot growth, commit, free.

Invariant: ``seq.block_table[:seq.num_committed_blocks]`` are published under ``seq.hashes[:n]``;
the rest are write-leased to this sequence alone. Only full blocks whose KV is computed are committed,
so a half-written block is never published. ``seq.block_leases[i]`` is the allocate lease behind
``block_table[i]`` (None for a cache hit, which the sequence's lookup lease covers).

Duplicates: when another sequence published the same hash first, kvd keeps its block, frees ours and
returns the canonical id. The table must switch to it at once, since the freed slot can be handed to
someone else on the next allocation.
"""
from __future__ import annotations

import time

from collections import defaultdict
from contextlib import AbstractContextManager, nullcontext
from typing import Callable

from kvd.hashing import block_hash, chain_hashes
from kvd.types import BlockHash, BlockId, LeaseId
from specd.engine.block_source import BlockSource, OutOfBlocks
from specd.engine.sequence import Sequence


RESERVE_FLOOR = 64          # blocks kept leased ahead with kvd (a refill may be posted whatever the need)
RESERVE_POOL_SHARE = 8      # ... but never more than 1/8 of the pool: idle reserve blocks cache nothing


class BlockManager:
    def __init__(self, source: BlockSource, block_size: int, root: BlockHash, reserve: int = 8,
                 reserve_floor: int = RESERVE_FLOOR):
        self.source = source
        self.block_size = block_size
        self.root = root
        # free blocks leased ahead of need, so a step rarely needs a round trip to kvd
        self._reserve: list[tuple[LeaseId, BlockId]] = []
        self._reserve_target = reserve           # extra blocks a blocking refill takes beyond the need
        # a source that can post an allocate (kvd) is refilled ahead of need, off the step's critical path:
        # up to max(reserve_floor, next step's expected need), capped at a share of the pool
        self._ahead = hasattr(source, "allocate_ahead")
        self._reserve_cap = getattr(source, "num_blocks", 0) // RESERVE_POOL_SHARE
        self._reserve_floor = min(reserve_floor, self._reserve_cap)
        self._in_flight = 0                      # blocks of the posted allocate not answered yet (0: none)
        # blocks of each allocate lease not yet given back (in the reserve or in a live sequence);
        # a lease is released only at zero, since one lease can feed several sequences
        self._outstanding: dict[LeaseId, int] = {}
        # a source with settle() (kvd) takes commits without waiting; a GroupSource (a hybrid model's
        # secondary group, whose window drops name canonical ids at once) commits synchronously
        self._defer = getattr(source, "defers_commits", False)

    # -- hashing -------------------------------------------------------------------------
    def extend_hashes(self, seq: Sequence) -> None:
        """Hash every newly full block of the token stream (prompt + output)."""
        bs, total = self.block_size, seq.num_tokens
        while (len(seq.hashes) + 1) * bs <= total:
            i = len(seq.hashes)
            parent = seq.hashes[-1] if seq.hashes else self.root
            seq.hashes.append(block_hash(parent, seq.ids(i * bs, (i + 1) * bs)))

    # -- prefix match --------------------------------------------------------------------
    def match_prefix(self, seq: Sequence) -> int:
        """Lease the cached prefix of the prompt; returns the number of cached tokens.
        At least one prompt token is always left to compute: its logits give the first sample."""
        self.extend_hashes(seq)
        usable = (len(seq.prompt_ids) - 1) // self.block_size
        seq.room_cut_blocks = 0
        if usable == 0 or not self.source.connected:
            return 0
        self._take_hit(seq, *self.source.lookup(seq.hashes[:usable], seq.request.session))
        return seq.num_cached_tokens

    def match_prefixes(self, seqs: list[Sequence]) -> None:
        """``match_prefix`` for each of ``seqs``, in one kvd round trip when the source batches lookups
        (the step's admissions): the same hits, leases and state as one lookup each."""
        many = getattr(self.source, "lookup_many", None)
        for seq in seqs:
            self.extend_hashes(seq)
        asking = [s for s in seqs if (len(s.prompt_ids) - 1) // self.block_size > 0]
        if many is None or len(asking) < 2 or not self.source.connected:
            for seq in asking:
                self.match_prefix(seq)
            return
        answers = many([(s.hashes[:(len(s.prompt_ids) - 1) // self.block_size], s.request.session) for s in asking])
        for seq, answer in zip(asking, answers):
            self._take_hit(seq, *answer)

    def _take_hit(self, seq: Sequence, lease: LeaseId | None, hits: list[BlockId], room_cut: int = 0) -> None:
        """Take a lookup's answer; ``room_cut`` (a source that can tell) counts the blocks past the hit that
        the cache holds but had no GPU room for (the scheduler may wait for room rather than recompute)."""
        seq.room_cut_blocks = room_cut
        if lease is not None:
            seq.leases.append(lease)
        seq.block_table.extend(hits)
        seq.block_leases.extend([None] * len(hits))
        seq.num_committed_blocks = seq.num_hit_blocks = len(hits)
        seq.num_cached_tokens = seq.num_computed_tokens = len(hits) * self.block_size

    def hit_leases(self, seq: Sequence) -> list[LeaseId]:
        """The lookup leases behind the sequence's hit (every group's, for a hybrid model)."""
        return list(seq.leases)

    def hit_landed(self, seq: Sequence) -> bool | None:
        """Whether the hit may be read: True, None (a promotion is in flight), False (it never will be).
        A source without promotions (a private pool, a test double) has only hits on the GPU."""
        landed = getattr(self.source, "landed", None)
        return True if landed is None else landed(self.hit_leases(seq))

    def poll(self) -> None:
        """Take the promotion answers that have arrived (never waits)."""
        if hasattr(self.source, "poll"):
            self.source.poll()

    def refresh_roots(self) -> None:
        """Post a refresh of the source's mirror of kvd's first blocks when one is due (kvd: ``RootFilter``,
        which skips the lookups that cannot hit); a source without one has nothing to do."""
        refresh = getattr(self.source, "refresh_roots", None)
        if refresh is not None:
            refresh(time.monotonic())

    def drain_in_forward(self) -> None:
        """Take the answers that have come while the launched forward runs (kvd: ``drain_in_forward``);
        ``after_forward`` must follow once the forward has been waited for."""
        drain = getattr(self.source, "drain_in_forward", None)
        if drain is not None:
            drain()

    def after_forward(self) -> None:
        done = getattr(self.source, "after_forward", None)
        if done is not None:
            done()

    def warm(self, prompt_ids: list[int]) -> bool:
        """Ask the source to start promoting a prompt's cached prefix now, before the prompt's lookup
        (kvd: ``warm``, prefetch on arrival); False when the source has no such thing (the local pool) or
        is not connected. Only the blocks ``match_prefix`` would look up are named."""
        warm = getattr(self.source, "warm", None)
        usable = (len(prompt_ids) - 1) // self.block_size
        if warm is None or usable <= 0 or not self.source.connected:
            return False
        return warm(chain_hashes(self.root, prompt_ids[:usable * self.block_size], self.block_size))

    def take_arrived(self) -> None:
        """Take the answers of posted ops that have arrived (a refill's blocks), never waiting; the
        scheduler calls this at the start of a step."""
        if self._in_flight and hasattr(self.source, "drain"):
            self.source.drain()

    def drop_hit(self, seq: Sequence) -> None:
        """Give up the sequence's hit (its promotion did not land in time, failed, or kvd is gone): release
        its lookup leases and recompute the prompt from the start."""
        self.free(seq)
        seq.reset_computed()
        seq.num_cached_tokens = 0

    # -- growth --------------------------------------------------------------------------
    def blocks_needed(self, seq: Sequence, new_tokens: int) -> int:
        need = -(-(seq.num_computed_tokens + new_tokens) // self.block_size)
        return max(0, need - len(seq.block_table))

    def ensure_slots(self, seq: Sequence, new_tokens: int) -> None:
        """Give ``seq`` room for ``new_tokens`` more KV entries. Raises OutOfBlocks and changes nothing."""
        n = self.blocks_needed(seq, new_tokens)
        if n == 0:
            return
        if len(self._reserve) < n and self._in_flight:
            self.settle()                          # the posted refill's answer: wait for it, not a new allocate
        if len(self._reserve) < n:
            # back to the floor, not just this sequence's need: the other prompts admitted in the same step
            # would each wait on a round trip of their own (session 10, CPU, tests/kvd/reserve_probe.py:
            # 18 blocking allocates for 24 requests, ~6 in each admission step after a batch emptied)
            extra = max(self._reserve_target, self._reserve_floor if self._ahead else 0)
            self._refill(n - len(self._reserve), extra)
        taken, self._reserve = self._reserve[:n], self._reserve[n:]
        seq.block_table.extend(block for _, block in taken)
        seq.block_leases.extend(lease for lease, _ in taken)

    def refill_ahead(self, expected: int) -> None:
        """Post an allocate so that the reserve covers ``expected`` blocks (the next step's need) and at
        least the floor, while the forward runs; its blocks join the reserve when the answer is taken
        (``take_arrived`` or ``settle``), never before. At most one refill is in flight."""
        want = max(self._reserve_floor, min(expected, self._reserve_cap))
        if not self._ahead or self._in_flight or len(self._reserve) >= want or not self.source.connected:
            return
        self._in_flight = n = want - len(self._reserve) + self._reserve_floor // 2   # hysteresis: fewer refills
        self.source.allocate_ahead(n, self._refilled)

    def _refilled(self, lease: LeaseId | None, blocks: list[BlockId]) -> None:
        """A posted refill's answer (None: refused, or kvd died first: nothing to add)."""
        self._in_flight = 0
        if lease is not None and blocks:
            self._outstanding[lease] = len(blocks)
            self._reserve.extend((lease, b) for b in blocks)

    def _refill(self, n: int, extra: int = 0) -> None:
        """A blocking allocate of ``n`` needed blocks and ``extra`` for the reserve; the need alone when
        the source cannot give both."""
        try:
            lease, blocks = self.source.allocate(n + extra)
        except OutOfBlocks:
            if extra <= 0:
                raise
            lease, blocks = self.source.allocate(n)
        self._outstanding[lease] = len(blocks)
        self._reserve.extend((lease, b) for b in blocks)

    # -- commit and free -----------------------------------------------------------------
    def commit_step(self, seqs: list[Sequence]) -> None:
        """``commit_full`` for the running sequences of a step, skipping those with no newly full,
        computed block: a decode step fills a block for ~1 in ``block_size`` sequences, and calling
        ``commit_full`` on the others (hashing checks included) cost 0.04 ms a step at 32 sequences on the
        CPU probe (docs/design/kvd.md, "Session 5"), for nothing.
        The skip is exact: with ``num_computed_tokens // block_size <= num_committed_blocks``,
        ``commit_full`` publishes nothing, and the hashes it would extend are extended by every reader
        that needs them (``match_prefix``, the engine's ``_finish``, the next ``commit_full``)."""
        for seq in seqs:
            if self.may_commit(seq):
                self.commit_full(seq)

    def may_commit(self, seq: Sequence) -> bool:
        """Whether ``commit_full(seq)`` can do anything: a full, computed block is not published yet."""
        return seq.num_computed_tokens // self.block_size > seq.num_committed_blocks

    def posting(self) -> AbstractContextManager:
        """Send the ops posted inside as one frame at the end, where the source can (kvd:
        ``KvdBlockSource.posting``); the engine wraps a step's output and commit phases in it."""
        return getattr(self.source, "posting", nullcontext)()

    def commit_full(self, seq: Sequence) -> None:
        """Publish every full, computed, not yet published block of ``seq``.

        With a source that defers commits (kvd), the commit is sent without waiting and the canonical
        ids land in the table whenever its answer is taken (a later step's ``drain`` or ``settle``).
        Until then the table keeps the sequence's own slot, which holds the same KV and which kvd keeps
        leased to it (protocol v3; the source gives it back after the switch). This sequence never
        writes a full block again. (Until session 7 kvd freed a duplicate's slot at the commit, so the
        engine had to wait for every commit answer before its next forward.)"""
        self.extend_hashes(seq)
        full = min(seq.num_computed_tokens // self.block_size, len(seq.hashes))
        if full <= seq.num_committed_blocks:
            return
        by_lease: dict[LeaseId, list[int]] = defaultdict(list)     # lease -> indices into the table
        for i in range(seq.num_committed_blocks, full):
            by_lease[seq.block_leases[i]].append(i)
        if self.source.connected:
            for lease, idx in by_lease.items():
                entries = [(seq.block_table[i], seq.hashes[i], seq.hashes[i - 1] if i > 0 else None) for i in idx]
                if self._defer:
                    self.source.commit(lease, entries, on_done=_canonical_into(seq, idx))
                else:
                    _canonical_into(seq, idx)(self.source.commit(lease, entries))
        seq.num_committed_blocks = full

    def settle(self) -> None:
        """Take the answers that have come, waiting only for those the next forward needs (a posted
        refill allocate's blocks; a source that cannot tell which waits for all). Commit answers are
        applied as they come: no forward waits for them (``commit_full``)."""
        if self._defer:
            getattr(self.source, "settle_needed", self.source.settle)()

    def free(self, seq: Sequence, hints: dict | None = None) -> None:
        """Release what the sequence holds: its lookup leases now, each allocate lease once no
        other sequence and no reserved block still uses it."""
        done = self._give_back(seq.block_leases)
        self.source.release(seq.leases + done, hints)
        seq.leases.clear()
        seq.block_table = []          # a new list: a deferred commit's answer must not touch it
        seq.block_leases.clear()
        seq.num_hit_blocks = seq.num_committed_blocks = 0

    def give_back_blocks(self, entries: list[tuple[LeaseId, BlockId]]) -> None:
        """A sequence no longer needs these blocks of its allocate leases (a sliding-window group's blocks
        behind the window): each lease gives them back now, or is released whole once unused."""
        by_lease: dict[LeaseId, list[BlockId]] = defaultdict(list)
        for lease, block in entries:
            by_lease[lease].append(block)
        for lease, blocks in by_lease.items():
            self._outstanding[lease] -= len(blocks)
            if self._outstanding[lease] == 0:
                del self._outstanding[lease]
                self.source.release([lease])
            else:
                self.source.release_blocks(lease, blocks)

    def release_reserve(self) -> bool:
        """Give back every reserve block (idle, reattach, shutdown), a refill in flight included: its
        answer is waited for first, so no lease of it is left behind. Returns whether anything was held
        (nothing held: no call to the source)."""
        if not self._reserve and not self._in_flight:
            return False
        if self._in_flight:
            self.settle()
        done = self._give_back([lease for lease, _ in self._reserve])
        self._reserve.clear()
        self.source.release(done)
        return True

    def _give_back(self, leases) -> list[LeaseId]:
        """One block of each listed allocate lease is no longer used; returns the leases now unused."""
        done = []
        for lease in leases:
            if lease is None:
                continue          # a cache hit: covered by the sequence's lookup lease
            self._outstanding[lease] -= 1
            if self._outstanding[lease] == 0:
                del self._outstanding[lease]
                done.append(lease)
        return done


def _canonical_into(seq: Sequence, idx: list[int]) -> Callable[[list[BlockId] | None], None]:
    """What to do with a commit's answer: switch each duplicate's table entry to kvd's canonical block,
    unless the sequence let go of that table meanwhile (``free`` gives it a new list: freed, or preempted
    and rebuilt, where an equal id at ``i`` would be a fresh slot, not the committed one)."""
    table = seq.block_table

    def apply(canonical: list[BlockId] | None) -> None:
        if seq.block_table is not table:
            return
        for i, block in zip(idx, canonical or ()):
            table[i] = block
    return apply
