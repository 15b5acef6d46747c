"""Deferred commits (a source with ``defers_commits``, as kvd's): the canonical id of a duplicate lands in
the block table at ``settle``, and never in a table the sequence has let go of meanwhile."""
import torch

from kvd.hashing import namespace_root
from specd.engine.block_manager import BlockManager
from specd.engine.block_source import LocalBlockSource
from specd.engine.detokenizer import Detokenizer
from specd.engine.request import Request
from specd.engine.sequence import Sequence
from specd.sampling_params import SamplingParams

ROOT = namespace_root("m", "t", "f32", "l", 4)
BS = 4


class DeferringSource(LocalBlockSource):
    """Publishes by hash like kvd; a commit with ``on_done`` is answered only at ``settle``."""
    defers_commits = True

    def __init__(self, n):
        super().__init__(n, 8, torch.device("cpu"))
        self.index = {}
        self.queued = []

    @property
    def connected(self):
        return True

    def lookup(self, hashes, session=None):
        return None, []

    def commit(self, lease, entries, on_done=None):
        out = []
        for b, h, _ in entries:
            if h in self.index:              # a duplicate: ours is freed, the first copy is canonical
                self._leases[lease].remove(b)
                self._free.append(b)
            else:
                self.index[h] = b
            out.append(self.index[h])
        self.queued.append((on_done, out))

    def settle(self):
        queued, self.queued = self.queued, []
        for on_done, out in queued:
            on_done(out)


def computed(bm, tokens, rid):
    seq = Sequence(Request(rid, list(tokens), SamplingParams()), Detokenizer(lambda x: ""), None)
    bm.ensure_slots(seq, len(tokens))
    seq.num_computed_tokens = len(tokens)
    return seq


def published_and_duplicate():
    """A block manager on a deferring source, sequence ``a`` committed and settled, and ``b``, computed over
    the same tokens on its own blocks and not committed yet."""
    bm = BlockManager(DeferringSource(16), BS, ROOT, reserve=0)
    a = computed(bm, range(9), "a")
    bm.commit_full(a)
    bm.settle()
    return bm, a, computed(bm, range(9), "b")


def test_a_duplicate_switches_to_the_canonical_block_only_at_settle():
    bm, a, b = published_and_duplicate()
    mine = list(b.block_table)
    bm.commit_full(b)
    assert b.block_table == mine and b.num_committed_blocks == 2      # nothing waited for the answer
    bm.settle()
    assert b.block_table[:2] == a.block_table[:2] and b.block_table[2] == mine[2]


def test_an_answer_never_touches_the_table_of_a_freed_sequence():
    bm, _, b = published_and_duplicate()
    bm.commit_full(b)
    bm.free(b)                       # finished (or preempted) before the answer came
    again = computed(bm, range(9), "b2")
    b.block_table = again.block_table       # even a rebuilt table of the same object is a new list
    fresh = list(b.block_table)
    bm.settle()
    assert b.block_table == fresh
