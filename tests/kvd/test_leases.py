import pytest

from kvd.core_types import KvdError, ReleaseHints
from kvd.types import BlockKind, Tier

from tests.kvd.conftest import h, put_chain


def test_lookup_leases_contiguous_prefix_and_release(make_core):
    core = make_core()
    ids = put_chain(core, [0, 1, 2])
    res = core.lookup("c", "full", [h(0), h(1), h(9), h(2)])
    assert res.hits == ids[:2] and res.tiers == [Tier.GPU, Tier.GPU] and res.ready
    assert core.stats()["leases"] == 1
    g = core.groups["full"]
    assert g.index.get(h(0)).refs == 1
    core.release("c", res.lease)
    assert g.index.get(h(0)).refs == 0 and core.stats()["leases"] == 0
    with pytest.raises(KvdError) as e:
        core.release("c", res.lease)
    assert e.value.code == "unknown_lease"


def test_miss_returns_no_lease(make_core):
    core = make_core()
    res = core.lookup("c", "full", [h(5)])
    assert res.lease == 0 and res.hits == [] and res.ready
    core.release("c", 0)  # accepted, nothing to do


def test_foreign_lease_is_refused(make_core):
    core = make_core()
    lease, _ = core.allocate("a", "full", 1)
    with pytest.raises(KvdError) as e:
        core.release("b", lease)
    assert e.value.code == "not_owner"


def test_leased_blocks_are_never_evicted(make_core):
    core = make_core(gpu_blocks=4)
    put_chain(core, [0, 1, 2, 3])
    res = core.lookup("c", "full", [h(0), h(1), h(2), h(3)])
    with pytest.raises(KvdError) as e:
        core.allocate("c", "full", 1)
    assert e.value.code == "out_of_blocks"
    core.release("c", res.lease)
    _, blocks = core.allocate("c", "full", 1)
    assert len(blocks) == 1


def test_ttl_reclaim_frees_uncommitted_and_never_publishes(make_core, clock):
    core = make_core(gpu_blocks=4, lease_ttl_s=10.0)
    put_chain(core, [0])
    read = core.lookup("dead", "full", [h(0)])
    lease, blocks = core.allocate("dead", "full", 2)
    core.commit("dead", lease, [(blocks[0], h(1), h(0))])  # one committed, one still being written
    clock.t += 5
    core.heartbeat("dead")
    clock.t += 9  # 14 s after start but only 9 after the heartbeat: alive
    assert core.tick()["reclaimed"] == 0
    clock.t += 2
    assert core.tick()["reclaimed"] == 2
    g = core.groups["full"]
    assert core.stats()["leases"] == 0 and core.stats()["reclaimed_leases"] == 2
    assert g.index.get(h(0)).refs == 0 and g.index.get(h(1)).refs == 0
    assert g.gpu.free_count == 2  # blocks[1] came back; h(0), h(1) stay cached
    assert len(g.index) == 2
    with pytest.raises(KvdError):
        core.commit("dead", lease, [(blocks[1], h(2), h(1))])


def test_commit_validation(make_core):
    core = make_core()
    lease, (a, b, c) = core.allocate("c", "full", 3)
    cases = [
        ([(a, b"short", None)], "bad_hash"),
        ([(a, h(1), h(77))], "bad_chain"),  # parent never committed
        ([(a, h(1), None), (b, h(2), h(99))], "bad_chain"),  # a chain that does not link
        ([(99, h(1), None)], "bad_block"),
        ([(a, h(1), None), (a, h(2), h(1))], "bad_block"),
        ([("x", h(1), None)], "bad_block"),
        ([(a, h(1))], "bad_request"),
    ]
    for items, code in cases:
        with pytest.raises(KvdError) as e:
            core.commit("c", lease, items)
        assert e.value.code == code, items
    assert len(core.groups["full"].index) == 0  # nothing half-published
    assert core.commit("c", lease, [(a, h(1), None), (b, h(2), h(1))]) == [a, b]


def test_duplicate_commit_returns_existing_id(make_core):
    core = make_core()
    (first,) = put_chain(core, [0])
    lease, (other,) = core.allocate("c", "full", 1)
    assert other != first
    assert core.commit("c", lease, [(other, h(0), None)]) == [first]
    core.release("c", lease)
    assert core.groups["full"].gpu.free_count == 3  # the duplicate's slot went back


def test_release_hints_and_sessions(make_core, clock):
    core = make_core()
    put_chain(core, [0, 1])
    res = core.lookup("c", "full", [h(0), h(1)], session="s1")
    core.release("c", res.lease, {"session": "s1", "kinds": {h(0): int(BlockKind.SYSTEM)},
                                  "turn_end": True, "expected_return_s": 30.0})
    g = core.groups["full"]
    assert g.index.get(h(0)).kind == BlockKind.SYSTEM
    assert g.index.get(h(1)).protect_until == clock.t + 30.0
    (s,) = core.sessions()
    assert s["session"] == "s1" and s["tail"] == h(1).hex() and s["expected_return_at"] == clock.t + 30
    with pytest.raises(KvdError):
        ReleaseHints.from_dict({"kinds": {h(0): 99}})


def test_batch_reports_each_op(make_core):
    core = make_core()
    out = core.batch("c", [{"op": "allocate", "group": "full", "n": 1}, {"op": "nope"},
                           {"op": "lookup", "group": "zzz", "hashes": []}])
    assert isinstance(out[0], tuple) and out[1].code == "bad_request" and out[2].code == "unknown_group"


def test_bad_inputs_are_typed(make_core):
    core = make_core()
    for call, code in [
        (lambda: core.lookup("c", "full", [b"x" * 15]), "bad_hash"),
        (lambda: core.lookup("c", "full", "notalist"), "bad_request"),
        (lambda: core.allocate("c", "full", -1), "bad_request"),
        (lambda: core.allocate("c", "full", 10**9), "out_of_blocks"),
        (lambda: core.attach("c", "full", 128), "group_mismatch"),
        (lambda: core.attach("c", "", 128), "bad_request"),
        (lambda: core.flush("c", "tape"), "bad_request"),
    ]:
        with pytest.raises(KvdError) as e:
            call()
        assert e.value.code == code
