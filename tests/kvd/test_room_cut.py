"""A lookup whose hit is cut because no GPU slot is free (every GPU block leased) says so: ``room_cut``
counts the blocks a lower tier still holds past the hit, so a client can wait for room rather than
recompute them (which would need as many GPU blocks). A cut for any other reason reports none."""
from kvd.types import Tier

from tests.kvd.conftest import h, put_chain, settle

CHAIN = [h(i) for i in range(4)]


def demoted_tail(make_core):
    """A 4-block GPU holding blocks 0-2 of a chain, block 3 demoted to DRAM by the cleaner, and the one
    free GPU slot leased to another client: no GPU slot can be had."""
    core = make_core(policy="lru-offload", gpu_blocks=4, dram_blocks=8)
    put_chain(core, [0, 1, 2, 3])
    settle(core)
    g = core.groups["full"]
    assert [g.index.get(x).tier for x in CHAIN] == [Tier.GPU] * 3 + [Tier.DRAM]
    busy, _ = core.allocate("other", "full", g.pools[Tier.GPU].free_count)
    assert g.pools[Tier.GPU].free_count == 0
    return core, busy


def test_a_hit_cut_for_want_of_gpu_room_reports_how_many_blocks_were_cut(make_core):
    core, busy = demoted_tail(make_core)
    res = core.lookup("c", "full", CHAIN)
    assert res.num_hits == 3 and res.room_cut == 1 and res.ready      # the GPU head, served as it is
    assert res.to_dict()["room_cut"] == 1
    stats = core.stats()
    assert stats["promotion_no_slot"] == 1 and stats["promotion_no_slot_blocks"] == 1
    core.release("c", res.lease)
    core.release("other", busy)                           # room again: the whole chain, one promotion
    again = core.lookup("c", "full", CHAIN)
    assert again.num_hits == 4 and again.room_cut == 0 and again.tiers[3] == Tier.DRAM
    assert core.wait_ready(again.lease, timeout=10)


def test_a_miss_or_a_hit_that_ends_where_the_cache_does_reports_no_room_cut(make_core):
    core = make_core(policy="lru-offload", gpu_blocks=4, dram_blocks=8)
    put_chain(core, [0, 1])
    assert core.lookup("c", "full", CHAIN).room_cut == 0            # a hit of 2, then nothing cached
    assert core.lookup("c", "full", [h(9)]).room_cut == 0            # nothing cached at all
    assert core.stats()["promotion_no_slot"] == 0


def test_the_client_reads_room_cut_and_defaults_it_for_an_older_kvd():
    from client.kvd_client import _lookup_result
    wire = {"lease": 5, "hits": [1, 2], "tiers": [0, 1], "ready": False, "first": 0}
    assert _lookup_result(wire).room_cut == 0
    assert _lookup_result({**wire, "room_cut": 3}).room_cut == 3
