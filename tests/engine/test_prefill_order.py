"""The scheduler's prefill order and its wait for GPU room, against the in-memory caching source.

Shortest first: once the waiting prompts' cache hits are known, the prompt with the fewest tokens left
to compute fills the step's budget first, running or waiting; a prompt queued ``starve_s`` goes in
arrival order. A hit that kvd cut for want of GPU room is given back and asked for again once a running sequence
has released its blocks, never kept short and recomputed unless the wait is over."""
import pytest

from specd.engine.block_manager import BlockManager
from specd.engine.scheduler import Scheduler
from specd.engine.sequence import SeqStatus
from tests.engine.test_block_manager import ROOT, CachingSource, seq_of
from tests.engine.test_parking import cached


def served(out):
    return [(s.seq.id, s.num_tokens) for s in out]


def step(out):
    for s in out:
        s.seq.num_computed_tokens += s.num_tokens


def scheduler_on(src, **kw):
    """A 4-seat scheduler over ``src`` with 4-token blocks and no reserve."""
    return Scheduler(BlockManager(src, 4, ROOT, reserve=0), max_num_seqs=4, **kw)


def running_long_and_a_cached_arrival(order):
    """A 40-token prompt running (10 of it computed), then a 43-token arrival whose first 40 are cached."""
    src = CachingSource(64)
    sched = scheduler_on(src, max_num_batched_tokens=10, prefill_order=order)
    history = list(range(100, 140))
    cached(src, sched.blocks, history)
    long = seq_of(range(40), "long")
    sched.add(long)
    step(sched.schedule())
    turn = seq_of(history + [7, 8, 9], "turn")
    sched.add(turn)
    return sched, long, turn


def test_a_cached_turn_is_served_ahead_of_a_long_recompute_that_arrived_first():
    sched, long, turn = running_long_and_a_cached_arrival("shortest")
    out = sched.schedule()
    assert turn.num_cached_tokens == 40
    assert served(out) == [("turn", 3), ("long", 7)]          # its 3 new tokens first, then the long chunk


def test_arrival_order_keeps_first_come_first_served():
    sched, long, turn = running_long_and_a_cached_arrival("arrival")
    assert served(sched.schedule()) == [("long", 10)]         # the running prompt takes the whole budget
    assert turn.status is SeqStatus.WAITING


def test_a_prompt_queued_past_starve_s_goes_first_whatever_its_length():
    sched, long, turn = running_long_and_a_cached_arrival("shortest")
    sched.starve_s = 0.5
    long.queued_s -= 0.6                                       # queued 0.6 s ago: overdue
    assert served(sched.schedule()) == [("long", 10)]
    long.queued_s += 0.6
    assert served(sched.schedule())[0] == ("turn", 3)          # not overdue any more: shortest again


def test_decoders_go_before_any_prompt_even_an_overdue_one():
    # shortest order with starve_s = 0: every prompt is overdue, the rank just below the decoders'
    sched = scheduler_on(CachingSource(64), max_num_batched_tokens=8, prefill_order="shortest", starve_s=0.0)
    dec, long = seq_of(range(3), "dec"), seq_of(range(50, 70), "long")
    sched.add(dec)
    step(sched.schedule())
    dec.output_ids.append(1)
    sched.add(long)
    assert served(sched.schedule()) == [("dec", 1), ("long", 7)]


def test_unknown_order_is_refused():
    with pytest.raises(ValueError, match="prefill_order"):
        scheduler_on(CachingSource(4), max_num_batched_tokens=8, prefill_order="lifo")


class RoomSource(CachingSource):
    """Cuts every lookup's hit after ``keep`` blocks while ``short_of_room``, reporting the rest as
    ``room_cut`` (what kvd answers when every GPU block is leased)."""

    def __init__(self, n):
        super().__init__(n)
        self.short_of_room, self.keep, self.lookups = False, 1, 0

    def lookup(self, hashes, session=None):
        self.lookups += 1
        lease, hits = super().lookup(hashes, session)
        if self.short_of_room and len(hits) > self.keep:
            return lease, hits[:self.keep], len(hits) - self.keep
        return lease, hits


def room_setup(park_limit_s=2.0):
    src = RoomSource(64)
    sched = scheduler_on(src, max_num_batched_tokens=64, park_limit_s=park_limit_s)
    history = list(range(100, 120))
    cached(src, sched.blocks, history)
    return src, sched, seq_of(history + [7], "turn")


def test_a_hit_cut_for_room_waits_while_others_run_then_takes_the_whole_hit():
    src, sched, turn = room_setup()
    other = seq_of(range(50, 53), "other")
    sched.add(other)
    step(sched.schedule())                                    # running: it will free room
    src.short_of_room = True
    sched.add(turn)
    out = sched.schedule()
    assert "turn" not in [s.seq.id for s in out] and turn.status is SeqStatus.WAITING
    assert turn.block_table == [] and turn.leases == []      # the short hit was given back
    assert sched.stats()["room_retries_total"] == 1
    src.short_of_room = False
    asked = src.lookups
    other.output_ids.append(1)
    step(sched.schedule())                                    # nobody released blocks: not asked again
    assert src.lookups == asked and turn.status is SeqStatus.WAITING
    sched.remove(other)                                       # it finishes: room may be back
    sched.blocks.free(other)
    out = sched.schedule()
    assert ("turn", 1) in served(out) and turn.num_cached_tokens == 20
    assert sched.stats()["room_waits_total"] == 1 and sched.stats()["room_waits_given_up_total"] == 0


def test_with_nothing_running_or_past_the_limit_the_short_hit_is_kept():
    src, sched, turn = room_setup()
    src.short_of_room = True
    sched.add(turn)
    assert served(sched.schedule()) == [("turn", 17)]        # nobody will free room: recompute the rest
    assert turn.num_cached_tokens == 4 and sched.stats()["room_waits_given_up_total"] == 1

    src, sched, turn = room_setup(park_limit_s=0.0)
    other = seq_of(range(50, 53), "other")
    sched.add(other)
    step(sched.schedule())
    src.short_of_room = True
    sched.add(turn)
    assert ("turn", 17) in served(sched.schedule())           # no time to wait
    assert sched.stats()["room_retries_total"] == 0


def test_after_a_room_cut_no_further_prompt_is_looked_up_in_that_step_but_batched_hits_are_all_checked():
    src, sched, turn = room_setup()
    other = seq_of(range(50, 53), "other")
    sched.add(other)
    step(sched.schedule())
    src.short_of_room = True
    second = seq_of(list(range(100, 120)) + [8, 9], "second")       # the same history: cut too
    third = seq_of(list(range(100, 104)) + [5], "third")             # a one-block hit: nothing to cut
    for s in (turn, second, third):
        sched.add(s)
    sched.schedule()                                                 # one batched lookup for all three
    assert turn.block_table == [] and second.block_table == []       # both gave their short hits back
    assert third.status is SeqStatus.RUNNING and third.num_cached_tokens == 4   # checked and admitted
    assert sched.stats()["room_retries_total"] == 2
    # the reserve is sized for the running two alone (1 token, 2 sequences: 1 + 1 blocks); counting the
    # held-back prompts' 43 tokens would have asked for 12 blocks, room their own hits are waiting for
    assert sched.expected_blocks() == 2
