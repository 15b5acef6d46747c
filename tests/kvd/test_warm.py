"""Prefetch on arrival (KvdCore.warm): a warm starts promoting what a later lookup of the same prompt hits,
without leasing it or counting an access; the lookup then holds the blocks in flight (or landed) and gets
the right bytes; a warm never takes a slot it would have to wait or drop for."""
from __future__ import annotations

import pytest
import torch

from kvd.core_types import KvdError
from kvd.types import Tier
from tests.kvd.conftest import h
from tests.kvd.test_batched_promotion import CHAIN, mixed  # noqa: F401 (fixture)
from tests.kvd.test_tiers import data


@pytest.fixture
def lower(mixed):
    """A chain of 8 blocks: 0-3 in DRAM, 4-7 on NVMe (test_batched_promotion's ``mixed``)."""
    return mixed


def test_warm_then_lookup_holds_the_moving_blocks_and_reads_right_bytes(lower):
    """The warm moves what free GPU slots allow (6 of 8 here); the lookup holds those in flight and
    promotes the other 2 itself; every block reads back right."""
    g = lower.groups["full"]
    before = {k: lower.stats()[k] for k in ("lookups", "hit_blocks")}
    sightings = [g.index.get(h(i)).sightings for i in CHAIN]
    free = g.gpu.free_count
    assert free == 6
    assert lower.warm("c", ["full"], [h(i) for i in CHAIN]) == free
    recs = [g.index.get(h(i)) for i in CHAIN]
    assert all(r.moving and r.refs == 0 for r in recs[:free])       # in flight, leased by nobody
    assert not any(r.moving for r in recs[free:])
    assert [r.sightings for r in recs] == sightings                 # a warm is no access
    assert {k: lower.stats()[k] for k in before} == before
    assert lower.stats()["warm_blocks"] == free and lower.stats()["warm_ops"] == 1
    warm_dest = [r.dest for r in recs[:free]]
    res = lower.lookup("c", "full", [h(i) for i in CHAIN])          # before the inline mover ran the batch
    assert len(res.hits) == 8 and not res.ready
    assert res.hits[:free] == warm_dest                             # the warm's destination slots
    assert lower.stats()["prefetch_promoted_blocks"] == 8 - free    # the lookup queued only the rest
    assert lower.wait_ready(res.lease, timeout=5)
    for i, b in zip(CHAIN, res.hits):
        assert torch.equal(g.gpu.tensor[b], data(i)), i
    assert all(r.tier == Tier.GPU and r.refs == 1 for r in recs)
    lower.release("c", res.lease)
    assert all(r.evictable for r in recs)                           # back in the policy once unleased
    st = lower.stats()
    assert st["promotion_batches"] == 2 and st["promotion_copy_seconds"] > 0
    assert st["promotion_queue_seconds"] >= 0
    assert 0 < st["promotion_issue_seconds"] <= st["promotion_copy_seconds"] and st["promotion_copies"] >= 2


def test_warm_alone_lands_unleased_and_evictable(lower):
    g = lower.groups["full"]
    assert lower.warm("c", ["full"], [h(i) for i in CHAIN[:4]]) == 4
    assert lower.mover.run_pending() == 1
    assert lower.stats()["promotion_backlog_s"] == 0.0
    recs = [g.index.get(h(i)) for i in CHAIN[:4]]
    assert all(r.tier == Tier.GPU and r.refs == 0 and not r.moving and r.evictable for r in recs)
    assert all(torch.equal(g.gpu.tensor[r.slot], data(i)) for r, i in zip(recs, CHAIN))
    again = lower.lookup("c", "full", [h(i) for i in CHAIN[:4]])
    assert again.ready and again.hits == [r.slot for r in recs]
    lower.release("c", again.lease)


def test_warm_of_gpu_blocks_or_misses_queues_nothing(lower):
    assert lower.warm("c", ["full"], [h(i) for i in range(100, 106)]) == 0     # all on the GPU already
    assert lower.warm("c", ["full"], [h(999)]) == 0                             # unknown prefix
    assert lower.mover.run_pending() == 0
    assert lower.stats()["warm_ops"] == 2 and lower.stats()["warm_blocks"] == 0


def test_warm_takes_only_free_slots(lower):
    """No free GPU slot: the warm stops there, dropping nothing and waiting for nobody (a lookup may)."""
    g = lower.groups["full"]
    on_gpu = {r.hash for r in g.index if r.tier == Tier.GPU}
    free = g.gpu.free_count
    assert 0 < free < 8
    assert lower.warm("c", ["full"], [h(i) for i in CHAIN]) == free              # the first ``free`` blocks
    assert g.gpu.free_count == 0
    assert g.counters["pressure_drops"] == 0 and g.counters["admission_rejects"] == 0
    assert all(x in g.index and g.index.get(x).tier == Tier.GPU for x in on_gpu)   # nothing evicted
    rest = [g.index.get(h(i)) for i in CHAIN[free:]]
    assert not any(r.moving for r in rest) and all(r.evictable for r in rest)    # still in the policy


def test_warm_respects_the_prefetch_budget(lower):
    """An NVMe block slower to promote than to recompute: the warm stops where the lookup's hit would."""
    g = lower.groups["full"]
    lower.rates.bps[Tier.NVME] = g.block_bytes / 10.0                            # 10 s per NVMe block
    assert lower.warm("c", ["full"], [h(i) for i in CHAIN], recompute_s=0.01) == 4   # the DRAM head only
    assert lower.stats()["prefetch_recompute_lookups"] == 0                     # a warm counts no decision


def test_bad_warms_are_typed_errors(lower):
    with pytest.raises(KvdError) as e:
        lower.warm("c", [], [h(0)])
    assert e.value.code == "bad_request"
    with pytest.raises(KvdError) as e:
        lower.warm("c", ["full", "full"], [h(0)])
    assert e.value.code == "bad_request"
    with pytest.raises(KvdError) as e:
        lower.warm("c", ["nope"], [h(0)])
    assert e.value.code == "unknown_group"
    with pytest.raises(KvdError) as e:
        lower.warm("c", ["full"], [h(0)], recompute_s=-1)
    assert e.value.code == "bad_request"


def test_warm_makes_the_hits_gpu_blocks_recent_without_counting_an_access(lower):
    """The cleaner refills the free slots a warm took by demoting its oldest victims: the hit's blocks
    already on the GPU must not be among them before the lookup comes."""
    g = lower.groups["full"]
    chain = [h(i) for i in range(100, 106)]
    before = [r.hash for r in g.policy.victims(Tier.GPU, 6)]
    assert set(before) == set(chain) and before[0] == h(105)            # released tail first: 105 is oldest
    sightings = [g.index.get(x).sightings for x in chain]
    assert lower.warm("c", ["full"], chain[:5]) == 0
    after = [r.hash for r in g.policy.victims(Tier.GPU, 6)]
    assert after == [h(105)] + chain[:5]                                # the warmed ones are now the newest
    assert [g.index.get(x).sightings for x in chain] == sightings
    assert all(g.index.get(x).count >= 1.0 for x in chain[:5])
