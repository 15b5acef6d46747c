"""The scheduler's parking of hits still being promoted, against an in-memory source whose promotions
land only when the test says so (fast unit tests; the real-kvd ones are test_parked_admission.py)."""
from specd.engine.block_manager import BlockManager
from specd.engine.scheduler import Scheduler
from specd.engine.sequence import SeqStatus
from tests.engine.test_block_manager import ROOT, CachingSource, seq_of


class PromotingSource(CachingSource):
    """Every lookup hit is "in flight" until ``land`` (or ``lose``) is called for its lease."""

    def __init__(self, n):
        super().__init__(n)
        self.state = {}            # lease -> None (in flight) | True | False

    def lookup(self, hashes, session=None):
        lease, hits = super().lookup(hashes, session)
        if hits:
            self.state[lease] = None
        return lease, hits

    def landed(self, leases):
        states = [self.state[lease] for lease in leases if lease in self.state]
        return False if False in states else None if None in states else True

    def poll(self):
        pass


def cached(src, bm, ids):
    """Serve ``ids`` once so its full blocks are published."""
    s = seq_of(ids, "warm")
    bm.match_prefix(s)
    bm.ensure_slots(s, len(ids))
    s.num_computed_tokens = len(ids)
    bm.commit_full(s)
    bm.free(s)


def test_a_parked_hit_lets_later_arrivals_run_then_takes_its_place_back():
    src = PromotingSource(64)
    bm = BlockManager(src, 4, ROOT, reserve=0)
    cached(src, bm, range(13))
    sched = Scheduler(bm, max_num_seqs=4, max_num_batched_tokens=64)
    hit, later, last = seq_of(range(13), "hit"), seq_of(range(50, 60), "later"), seq_of(range(70, 75), "last")
    sched.add(hit)
    sched.add(later)
    out = sched.schedule()
    assert [s.seq.id for s in out] == ["later"] and hit.status is SeqStatus.PARKED
    assert len(hit.block_table) == 3 == hit.num_hit_blocks        # the hit only: nothing allocated
    sched.schedule()
    assert hit.status is SeqStatus.PARKED and sched.stats()["requests_parked"] == 1
    src.state[hit.leases[0]] = True
    sched.add(last)
    out = sched.schedule()
    # back in the queue: the landed hit has one token left, so it goes with the decoders, ahead of the
    # later arrival; the other prompts follow in arrival order (Scheduler._rank)
    assert [s.seq.id for s in out] == ["hit", "later", "last"]
    assert out[0].num_tokens == 1 and hit.num_cached_tokens == 12
    assert sched.stats()["parked_admitted_total"] == 1


def test_a_lost_or_late_hit_is_recomputed_and_an_abort_releases_it():
    src = PromotingSource(64)
    bm = BlockManager(src, 4, ROOT, reserve=0)
    cached(src, bm, range(13))
    sched = Scheduler(bm, max_num_seqs=4, max_num_batched_tokens=64, park_limit_s=0.0)
    lost, late, gone = seq_of(range(13), "lost"), seq_of(range(13), "late"), seq_of(range(13), "gone")
    for s in (lost, late, gone):
        sched.add(s)
    assert sched.schedule() == []
    src.state[lost.leases[0]] = False
    lease = gone.leases[0]
    sched.remove(gone)
    bm.free(gone)
    assert lease in src.released
    out = sched.schedule()
    assert [s.seq.id for s in out] == ["lost", "late"]
    assert all(s.num_tokens == 13 and s.seq.num_cached_tokens == 0 for s in out)   # recomputed from token 0
    st = sched.stats()
    assert st["parked_giveups_total"] == 2 and st["parked_total"] == 3 and st["requests_parked"] == 0


def test_only_parked_holds_exactly_while_nothing_else_can_run():
    src = PromotingSource(64)
    bm = BlockManager(src, 4, ROOT, reserve=0)
    cached(src, bm, range(13))
    sched = Scheduler(bm, max_num_seqs=4, max_num_batched_tokens=64)
    hit = seq_of(range(13), "hit")
    sched.add(hit)
    assert not sched.only_parked()                                 # waiting, not looked up yet
    assert sched.schedule() == [] and hit.status is SeqStatus.PARKED and sched.only_parked()
    sched.add(seq_of(range(50, 60), "later"))
    assert not sched.only_parked()                                 # a runnable arrival
