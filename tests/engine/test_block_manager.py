"""Block bookkeeping against a tiny in-memory caching source (a unit-test stand-in for kvd)."""
import pytest
import torch

from kvd.hashing import chain_hashes, namespace_root
from specd.engine.block_manager import BlockManager
from specd.engine.block_source import LocalBlockSource, OutOfBlocks
from specd.engine.detokenizer import Detokenizer
from specd.engine.request import Request
from specd.engine.scheduler import Scheduler
from specd.engine.sequence import Sequence
from specd.sampling_params import SamplingParams

ROOT = namespace_root("m", "t", "f32", "l", 4)


class CachingSource(LocalBlockSource):
    """LocalBlockSource plus a hash index, with kvd's lease rules: a released lease frees its
    uncommitted blocks; committed blocks stay cached."""

    def __init__(self, n):
        super().__init__(n, 8, torch.device("cpu"))
        self.index = {}           # hash -> block
        self.committed = set()
        self.released = []

    @property
    def connected(self):
        return True

    def lookup(self, hashes, session=None):
        hits = []
        for h in hashes:
            if h not in self.index:
                break
            hits.append(self.index[h])
        lease, _ = self.allocate(0)
        return lease, hits

    def commit(self, lease, entries):
        assert all(b in self._leases[lease] for b, _, _ in entries)
        out = []
        for b, h, parent in entries:
            assert parent is None or parent in self.index
            if h in self.index:                 # a duplicate: ours is freed, the first copy is canonical
                self._leases[lease].remove(b)
                self._free.append(b)
            else:
                self.index[h] = b
                self.committed.add(b)
            out.append(self.index[h])
        return out

    def release(self, leases, hints=None):
        for lease in leases:
            self.released.append(lease)
            blocks = self._leases.pop(lease)
            self._free.extend(b for b in blocks if b not in self.committed)


def seq_of(ids, rid="r"):
    return Sequence(Request(rid, list(ids), SamplingParams()), Detokenizer(lambda x: ""), None)


def test_prefix_hit_leaves_one_token_to_compute_and_commits_in_chain():
    src = CachingSource(32)
    bm = BlockManager(src, 4, ROOT, reserve=0)
    a = seq_of(range(12))
    assert bm.match_prefix(a) == 0
    bm.ensure_slots(a, 12)
    a.num_computed_tokens = 12
    bm.commit_full(a)
    assert a.num_committed_blocks == 3
    assert [src.index[h] for h in chain_hashes(ROOT, list(range(12)), 4)] == a.block_table[:3]
    bm.free(a)
    b = seq_of(range(12), "b")             # same prompt: 2 of 3 blocks usable (one token must remain)
    assert bm.match_prefix(b) == 8
    assert b.num_pending == 4
    c = seq_of(list(range(8)) + [99, 98, 97, 96, 95], "c")
    assert bm.match_prefix(c) == 8


def test_partial_block_is_never_committed_and_is_freed():
    src = CachingSource(8)
    bm = BlockManager(src, 4, ROOT, reserve=0)
    a = seq_of(range(6))
    bm.match_prefix(a)
    bm.ensure_slots(a, 6)
    a.num_computed_tokens = 6
    bm.commit_full(a)
    assert a.num_committed_blocks == 1
    bm.free(a)
    assert src.num_free() == 7            # the half block came back, the full one stays cached


def test_shared_allocate_lease_is_released_only_when_every_user_is_done():
    src = CachingSource(16)
    bm = BlockManager(src, 4, ROOT, reserve=4)
    a, b = seq_of(range(3), "a"), seq_of(range(100, 103), "b")
    bm.ensure_slots(a, 3)
    bm.ensure_slots(b, 3)               # served from the same reserve lease as a
    bm.free(a)
    assert src.released == []           # b and the reserve still use that lease
    bm.free(b)
    bm.release_reserve()
    assert len(src.released) == 1
    assert src.num_free() == 16


def test_scheduler_decodes_first_and_chunks_long_prompts():
    src = CachingSource(64)
    bm = BlockManager(src, 4, ROOT, reserve=0)
    sched = Scheduler(bm, max_num_seqs=4, max_num_batched_tokens=10)
    short, long = seq_of(range(3), "s"), seq_of(range(200, 230), "l")
    sched.add(short)
    sched.add(long)
    first = sched.schedule()
    assert [(s.seq.id, s.num_tokens) for s in first] == [("s", 3), ("l", 7)]
    assert first[0].samples and not first[1].samples
    for s in first:
        s.seq.num_computed_tokens += s.num_tokens
    short.output_ids.append(5)
    second = sched.schedule()
    assert [(s.seq.id, s.num_tokens) for s in second] == [("s", 1), ("l", 9)]


def test_out_of_blocks_preempts_the_newest_sequence():
    src = CachingSource(4)
    bm = BlockManager(src, 4, ROOT, reserve=0)
    sched = Scheduler(bm, max_num_seqs=4, max_num_batched_tokens=64)
    a, b = seq_of(range(8), "a"), seq_of(range(50, 58), "b")
    sched.add(a)
    sched.add(b)
    for s in sched.schedule():
        s.seq.num_computed_tokens += s.num_tokens
        s.seq.output_ids.append(1)
    a.output_ids.append(1)             # a now needs a third block; none is free
    with pytest.raises(OutOfBlocks):
        src.allocate(1)
    out = sched.schedule()
    assert [s.seq.id for s in out] == ["a"]
    assert sched.num_preemptions == 1 and list(sched.waiting) == [b]


def test_duplicate_commit_switches_to_the_canonical_block():
    src = CachingSource(16)
    bm = BlockManager(src, 4, ROOT, reserve=0)
    a, b = seq_of(range(9), "a"), seq_of(range(9), "b")
    for s in (a, b):                      # both miss, both compute the same two full blocks
        bm.match_prefix(s)
        bm.ensure_slots(s, 9)
        s.num_computed_tokens = 9
    bm.commit_full(a)
    mine = list(b.block_table[:2])
    bm.commit_full(b)
    assert b.block_table[:2] == a.block_table[:2] != mine
    assert set(mine) <= set(src._free)    # b's copies went back to the pool ...
    bm.free(a)
    bm.free(b)
    assert src.num_free() == 16 - 2       # ... and only the two canonical blocks stay cached
