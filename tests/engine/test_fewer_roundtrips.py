"""Fewer blocking kvd round trips per step: the reserve is refilled by a posted allocate whose blocks are
used only once its answer arrived, the step's admissions look up in one round trip, and nothing stays
leased once the engine is idle or kvd dies."""
from __future__ import annotations

import time

import pytest
import torch

from bench.kvd_process import KvdProcess
from client.kvd_client import KvdClient
from kvd.hashing import namespace_root
from specd.engine.block_manager import BlockManager
from specd.engine.block_source import LocalBlockSource
from specd.engine.config import EngineConfig
from specd.engine.detokenizer import Detokenizer
from specd.engine.engine import SpecEngine
from specd.engine.kvd_source import CALL_TIMEOUT_S
from specd.engine.request import Request
from specd.engine.scheduler import Scheduler
from specd.engine.sequence import Sequence
from specd.sampling_params import SamplingParams

ROOT = namespace_root("m", "t", "f32", "l", 4)
BS = 4
STORY = ("Once upon a time, there was a little girl named Lily. She loved to play outside in the park. "
         "One day, she saw a big, red ball.")


class PostingSource(LocalBlockSource):
    """kvd's posting behaviour in memory: an ``allocate_ahead`` is answered only at ``drain``/``settle``
    (the answer 'arrives' when ``deliver`` is set), lookups by hash, counted."""
    defers_commits = True

    def __init__(self, n):
        super().__init__(n, 8, torch.device("cpu"))
        self.posted = []           # on_done of posted allocates, answered in order
        self.deliver = False       # whether a drain finds the answers on the socket
        self.sync_allocates = self.settles = 0
        self.index = {}
        self.lookups = self.batches = 0

    @property
    def connected(self):
        return True

    def allocate(self, n, group=None):
        self.sync_allocates += 1
        return super().allocate(n)

    def allocate_ahead(self, n, on_done):
        self.posted.append((n, on_done))

    def _answer(self):
        posted, self.posted = self.posted, []
        for n, on_done in posted:
            on_done(*LocalBlockSource.allocate(self, n))

    def drain(self):
        if self.deliver:
            self._answer()

    def settle(self):
        self.settles += 1
        self._answer()

    def commit(self, lease, entries, on_done=None):
        for b, h, _ in entries:
            self.index.setdefault(h, b)
        on_done([self.index[h] for _, h, _ in entries])

    def lookup(self, hashes, session=None):
        self.lookups += 1
        hits = []
        for h in hashes:
            if h not in self.index:
                break
            hits.append(self.index[h])
        return (super().allocate(0)[0] if hits else None), hits

    def lookup_many(self, requests):
        self.batches += 1
        before = self.lookups
        out = [self.lookup(hashes, session) for hashes, session in requests]
        self.lookups = before
        return out


def seq_of(tokens, rid):
    return Sequence(Request(rid, list(tokens), SamplingParams()), Detokenizer(lambda x: ""), None)


def test_a_posted_refill_is_used_only_once_its_answer_arrived():
    src = PostingSource(64)
    bm = BlockManager(src, BS, ROOT, reserve=0, reserve_floor=8)     # floor capped at 64 // 8 = 8
    bm.refill_ahead(expected=2)
    assert len(src.posted) == 1 and bm._reserve == []                # in flight: no block id known yet
    bm.take_arrived()                                                 # not on the socket yet: nothing
    assert bm._reserve == []
    bm.refill_ahead(expected=2)
    assert len(src.posted) == 1                                       # at most one refill in flight
    a = seq_of(range(33), "a")
    bm.ensure_slots(a, 33)                                            # short: waits for the refill's answer
    assert src.settles == 1 and src.sync_allocates == 0
    assert len(a.block_table) == 9 and all(lease is not None for lease in a.block_leases)
    src.deliver = True
    bm.refill_ahead(expected=2)                                       # 3 left, below the floor: posted
    assert len(src.posted) == 1 and len(bm._reserve) == 3
    bm.take_arrived()                                                 # answered during the "forward"
    assert len(bm._reserve) == 12
    b = seq_of(range(5), "b")
    bm.ensure_slots(b, 5)
    assert src.sync_allocates == 0 and src.settles == 1               # no blocking call at all
    assert not set(a.block_table) & set(b.block_table)


def test_an_unused_reserve_and_a_refill_in_flight_are_given_back():
    src = PostingSource(64)
    bm = BlockManager(src, BS, ROOT, reserve=0, reserve_floor=8)
    bm.refill_ahead(expected=1)
    src.deliver = True
    bm.take_arrived()
    a = seq_of(range(41), "a")
    bm.ensure_slots(a, 41)                                            # 11 of the 12 blocks
    bm.refill_ahead(expected=8)                                       # reserve below target: a second refill
    assert len(src.posted) == 1
    bm.release_reserve()                                              # waits for it, then gives back the rest
    assert list(src._leases) == [a.block_leases[0]]                   # only a's lease is still held
    bm.free(a)
    assert src.num_free() == 64 and not src._leases


def test_a_refused_refill_adds_nothing_and_a_blocking_allocate_still_serves():
    src = PostingSource(64)
    src.allocate_ahead = lambda n, on_done: on_done(None, [])        # refused (out_of_blocks, kvd died)
    bm = BlockManager(src, BS, ROOT, reserve=0, reserve_floor=8)
    bm.refill_ahead(expected=4)
    a = seq_of(range(9), "a")
    bm.ensure_slots(a, 9)
    assert src.sync_allocates == 1 and len(a.block_table) == 3


def test_a_blocking_refill_restores_the_reserve_floor_for_the_rest_of_the_step():
    """An empty reserve (the batch had just emptied and given it back) and no refill in flight: the first
    admission's blocking allocate also takes the floor, so the step's next admissions need no round trip
    of their own (session 10, tests/kvd/reserve_probe.py: 18 blocking allocates for 24 requests before,
    ~6 per admission step)."""
    src = PostingSource(256)
    bm = BlockManager(src, BS, ROOT, reserve=0, reserve_floor=16)
    seqs = [seq_of(range(9), f"p{i}") for i in range(4)]             # 3 blocks each
    for s in seqs:
        bm.ensure_slots(s, 9)
    assert src.sync_allocates == 1 and all(len(s.block_table) == 3 for s in seqs)
    assert len(bm._reserve) == 3 + 16 - 12                            # the need and the floor taken, 12 used
    plain = BlockManager(LocalBlockSource(256, 8, torch.device("cpu")), BS, ROOT, reserve=0)
    plain.ensure_slots(seq_of(range(9), "q"), 9)                      # no posting source: the need only
    assert not plain._reserve


def test_admissions_of_one_step_look_up_together_with_the_same_hits():
    src = PostingSource(256)
    bm = BlockManager(src, BS, ROOT, reserve=0, reserve_floor=0)
    warm = seq_of(range(17), "w")
    bm.ensure_slots(warm, 17)
    warm.num_computed_tokens = 17
    bm.commit_full(warm)                                              # blocks 0..3 published
    prompts = [list(range(17)), list(range(9)) + [99] * 8, [7] * 17, list(range(13))]
    sched = Scheduler(bm, max_num_seqs=8, max_num_batched_tokens=512)
    seqs = [seq_of(p, f"s{i}") for i, p in enumerate(prompts)]
    for s in seqs:
        sched.add(s)
    sched.schedule()
    assert src.batches == 1 and src.lookups == 0                      # one round trip, no single lookups
    batched = [s.num_cached_tokens for s in seqs]
    one_by_one = []
    for i, p in enumerate(prompts):
        s = seq_of(p, f"o{i}")
        one_by_one.append(bm.match_prefix(s))
    assert batched == one_by_one == [16, 8, 0, 12]


def generate(engine, prompts, max_tokens=12):
    for i, p in enumerate(prompts):
        engine.add_request(Request(f"r{i}", p, SamplingParams(temperature=0.0, max_tokens=max_tokens)))
    got = {f"r{i}": [] for i in range(len(prompts))}
    while engine.has_work():
        for out in engine.step():
            assert out.error is None
            got[out.id] += out.token_ids
    return [got[f"r{i}"] for i in range(len(prompts))]


def prompts_for(engine):
    base = engine.tokenizer.encode(STORY)
    tails = [" Her friend Tom came to play.", " The ball was very big.", " She was happy.", " It rained."]
    return [base] + [base + engine.tokenizer.encode(t, add_bos=False) for t in tails]


@pytest.mark.slow
def test_engine_batches_lookups_matches_uncached_and_leaves_no_lease_when_idle(tmp_path):
    local = SpecEngine.from_config(EngineConfig())
    with KvdProcess(tmp_path / "kvd", gpu_bytes=8 << 20, dram_bytes=0) as kvd:
        cached = SpecEngine.from_config(EngineConfig(kvd_run_dir=kvd.run_dir))
        prompts = prompts_for(cached)
        want = generate(local, prompts)
        first = generate(cached, prompts[:1])                # publishes the shared prefix
        before = cached.stats()
        got = generate(cached, prompts[1:])                  # four admissions in one step
        after = cached.stats()
        assert first == want[:1] and got == want[1:]         # greedy output equals uncached
        assert after["kvd_rpc_batch_total"] - before.get("kvd_rpc_batch_total", 0) == 1
        assert after["kvd_rpc_lookup_total"] == before["kvd_rpc_lookup_total"]
        assert after["cached_tokens_total"] - before["cached_tokens_total"] == 4 * ((len(prompts[0]) - 1) // 16 * 16)
        assert after["kvd_posted_total"] > after["kvd_blocking_calls_total"] > 0
        with KvdClient(kvd.run_dir) as c:
            assert c.leases()                                # the reserve outlives the last request ...
            assert cached.release_idle()                     # ... until the engine is idle (the server's poll)
            deadline = time.monotonic() + 5.0                # the release is posted: kvd takes it in a moment
            while c.leases() and time.monotonic() < deadline:
                time.sleep(0.01)
            assert c.leases() == []                          # then no reserve, no hit lease left
            assert not cached.release_idle()                 # nothing held: no call


@pytest.mark.slow
def test_kvd_killed_with_a_refill_in_flight_degrades_and_serves_correctly(tmp_path):
    local = SpecEngine.from_config(EngineConfig())
    proc = KvdProcess(tmp_path / "kvd", gpu_bytes=8 << 20, dram_bytes=0).start()
    try:
        engine = SpecEngine.from_config(EngineConfig(kvd_run_dir=proc.run_dir))
        prompts = prompts_for(engine)
        want = generate(local, prompts, max_tokens=40)
        for i, p in enumerate(prompts):
            engine.add_request(Request(f"r{i}", p, SamplingParams(temperature=0.0, max_tokens=40)))
        got = {f"r{i}": [] for i in range(len(prompts))}
        for out in engine.step():                            # admits all; posts a refill before its forward
            got[out.id] += out.token_ids
        assert engine.blocks._in_flight or engine.blocks._reserve
        proc.kill()
        while engine.has_work():
            for out in engine.step():
                assert out.error is None
                got[out.id] += out.token_ids
        assert [got[f"r{i}"] for i in range(len(prompts))] == want
        # decode steps post their commits and wait on nothing (protocol v3): kvd's death is noticed by
        # the next waited call or, as here, by a drain once a post is older than the call timeout
        time.sleep(CALL_TIMEOUT_S + 0.2)
        engine.blocks.source.drain()
        assert engine.stats()["kvd_connected"] == 0
    finally:
        proc.stop()
