"""Cache groups with a tail rule (kvd/hybrid_hits.py): sliding-window and state-snapshot groups keep only
the blocks some servable end still needs, and a joint hit is the longest end every group can serve."""
from __future__ import annotations

import pytest

from kvd.core_types import KvdError
from kvd.hybrid_hits import needed_from, tail_blocks, valid_ends
from kvd.types import Tier

from tests.kvd.conftest import BB, h, settle


def test_tail_blocks_cover_the_first_query_after_a_hit():
    """Brute force: after a hit of h blocks the next query sits at h*bs and sees keys > h*bs - W;
    the blocks holding those keys are exactly the last tail_blocks(W, bs) blocks (fewer near 0)."""
    for bs in (1, 4, 16):
        for w in range(1, 70):
            for hit in range(0, 12):
                pos = hit * bs
                keys = [k for k in range(pos) if k > pos - w]
                first = min((k // bs for k in keys), default=hit)
                assert needed_from(hit, tail_blocks(w, bs)) <= first, (bs, w, hit)
                if w > 1 and hit * bs >= w:   # tight once the window is behind the start
                    assert needed_from(hit, tail_blocks(w, bs)) == first, (bs, w, hit)


def test_valid_ends():
    present = [False, False, True, True, False, True]
    assert valid_ends(present, None) == [True, False, False, False, False, False, False]
    assert valid_ends(present, 2) == [True, False, False, False, True, False, False]
    assert valid_ends(present, 1) == [True, False, False, True, True, False, True]
    assert valid_ends([True] * 3, 2) == [True] * 4     # short prefixes need only what exists


def attach_swa(core, k=2, blocks=16):
    core.attach("c", "swa", BB, tail_blocks=k)


def commit_chain(core, group, n, start=0):
    """Allocate and commit blocks start..n-1 of the test chain in ``group``; returns the write lease."""
    lease, ids = core.allocate("c", group, n - start)
    items = [(b, h(i), h(i - 1) if i else None) for b, i in zip(ids, range(start, n))]
    core.commit("c", lease, items)
    return lease


def present(core, group, n):
    return [core.groups[group].index.get(h(i)) is not None for i in range(n)]


def test_passed_blocks_are_dropped_once_unleased_and_never_demoted(make_core):
    core = make_core(gpu_blocks=16, dram_blocks=16, policy="lru-offload", clean_low=0.99, clean_high=0.99)
    attach_swa(core, k=2)
    for g in ("full", "swa"):
        core.release("c", commit_chain(core, g, 10))
    assert present(core, "full", 10) == [True] * 10
    assert present(core, "swa", 10) == [False] * 8 + [True, True]   # only the last end's window
    assert core.stats()["window_drops"] == 8
    # the cleaner (watermarks at 99%) demotes blocks 8, 9 (still needed) to DRAM; then a new chain passes
    # them and they are dropped from DRAM too; nothing passed is ever kept below
    settle(core)
    assert core.groups["swa"].pools[Tier.DRAM].used_count == 2
    core.release("c", commit_chain(core, "swa", 16 + 10, start=10))
    swa = core.groups["swa"]
    assert present(core, "swa", 26) == [False] * 24 + [True, True]
    assert swa.counters["demotions"] == 2 and swa.pools[Tier.DRAM].used_count == 0


def test_joint_hit_is_the_longest_end_every_group_serves(make_core):
    core = make_core(gpu_blocks=16)
    attach_swa(core, k=2)
    core.release("c", commit_chain(core, "full", 10))
    core.release("c", commit_chain(core, "swa", 6))          # swa ends servable: 6 (blocks 4, 5)
    res = core.lookup_groups("c", ["full", "swa"], [h(i) for i in range(10)])
    assert res.hit == 6
    assert len(res.results["full"].hits) == 6 and res.results["full"].first == 0
    assert len(res.results["swa"].hits) == 2 and res.results["swa"].first == 4
    assert res.results["swa"].hits == [core.groups["swa"].index.get(h(i)).slot for i in (4, 5)]
    # a query of 5 blocks: end 5 needs swa 3, 4 but block 3 was passed -> shortened to... nothing
    short = core.lookup_groups("c", ["full", "swa"], [h(i) for i in range(5)])
    assert short.hit == 0 and short.results["swa"].lease == 0 and short.results["full"].lease == 0
    for r in res.results.values():
        core.release("c", r.lease)
    # the leases were real: released blocks are evictable again
    assert core.stats()["leases"] == 0


def test_a_leased_passed_block_stays_until_released(make_core):
    core = make_core(gpu_blocks=16)
    attach_swa(core, k=1)
    core.release("c", commit_chain(core, "swa", 3))              # keeps block 2 only
    got = core.lookup_groups("c", ["swa"], [h(i) for i in range(3)])
    assert got.hit == 3 and got.results["swa"].first == 2
    core.release("c", commit_chain(core, "swa", 5, start=3))     # passes 2 while it is leased
    assert present(core, "swa", 5) == [False, False, True, False, True]
    core.release("c", got.results["swa"].lease)
    assert present(core, "swa", 5) == [False, False, False, False, True]


def test_group_kind_is_part_of_its_identity(make_core):
    core = make_core()
    attach_swa(core, k=2)
    with pytest.raises(KvdError) as e:
        core.attach("c", "swa", BB, tail_blocks=3)
    assert e.value.code == "group_mismatch"
    with pytest.raises(KvdError) as e:
        core.lookup_groups("c", ["full", "full"], [h(0)])
    assert e.value.code == "bad_request"


def test_release_blocks_gives_back_part_of_a_lease(make_core):
    core = make_core(gpu_blocks=8)
    lease, ids = core.allocate("c", "full", 4)
    core.commit("c", lease, [(ids[0], h(0), None), (ids[1], h(1), h(0))])
    with pytest.raises(KvdError) as e:                  # refused as a whole: nothing changes
        core.release_blocks("c", lease, [ids[2], ids[2]])
    assert e.value.code == "bad_block" and core.groups["full"].gpu.free_count == 4
    core.release_blocks("c", lease, [ids[0], ids[2]])   # a published block unpinned, a write slot freed
    g = core.groups["full"]
    assert g.index.get(h(0)).refs == 0 and g.index.get(h(1)).refs == 1 and g.gpu.free_count == 5
    core.commit("c", lease, [(ids[3], h(2), h(1))])
    core.release("c", lease)
    assert core.stats()["leases"] == 0 and all(r.refs == 0 for r in g.index)
