"""Each policy's victim order on a small pool, exactly."""
from kvd.types import Tier

from tests.kvd.conftest import h, put_chain, settle


def resident(core, tier=Tier.GPU):
    return {r.hash for r in core.groups["full"].index if r.tier == tier}


def test_lru_evicts_least_recently_released_tail_first(make_core, clock):
    core = make_core(policy="lru", gpu_blocks=4)
    put_chain(core, [0, 1])  # released tail first: queue 1, 0
    put_chain(core, [2, 3])  # queue 1, 0, 3, 2
    res = core.lookup("c", "full", [h(0)])
    core.release("c", res.lease)  # queue 1, 3, 2, 0
    pol = core.groups["full"].policy
    assert [r.hash for r in pol.victims(Tier.GPU, 4)] == [h(1), h(3), h(2), h(0)]
    core.allocate("c", "full", 2)
    assert resident(core) == {h(2), h(0)}
    assert core.stats()["evictions"] == 2


def test_lru_offload_demotes_to_dram_then_drops_by_lru(make_core):
    # watermarks at 99%: the cleaner empties the GPU tier whenever it runs
    core = make_core(policy="lru-offload", gpu_blocks=2, dram_blocks=2, clean_low=0.99, clean_high=0.99)
    put_chain(core, [0, 1])
    settle(core)  # 1 then 0 demoted (no admission gate)
    assert resident(core, Tier.DRAM) == {h(0), h(1)} and resident(core) == set()
    put_chain(core, [2, 3])
    settle(core)  # 3 then 2 demoted; DRAM drops 1 then 0 to make room
    assert resident(core, Tier.DRAM) == {h(2), h(3)}
    s = core.stats()
    assert s["demotions"] == 4 and s["evictions"] == 2


def test_reuse_order_dead_tails_then_coldest_leaves(make_core, clock):
    core = make_core(policy="reuse", gpu_blocks=5)
    put_chain(core, [0, 1, 2])  # tail 2 is a never-reused leaf
    put_chain(core, [3, 4])  # tail 4 likewise, shallower than 2
    clock.t += 100
    core.release("c", core.lookup("c", "full", [h(0), h(1)]).lease)  # 0, 1 warmer
    order = []
    for _ in range(5):
        before = resident(core)
        core.allocate("c", "full", 1)  # held: each allocation evicts exactly one block
        order += list(before - resident(core))
    # dead tails first (the older first: the depth term is off in service), then the cold leaf 3, then 1
    # before its parent 0
    assert order == [h(2), h(4), h(3), h(1), h(0)]


def test_reuse_protects_live_session_tail_and_system_prompt(make_core, clock):
    core = make_core(policy="reuse", gpu_blocks=3)
    put_chain(core, [0])
    put_chain(core, [1])
    put_chain(core, [2])
    core.release("c", core.lookup("c", "full", [h(1)]).lease,
                 {"turn_end": True, "expected_return_s": 600.0})
    core.release("c", core.lookup("c", "full", [h(0)]).lease, {"kinds": {h(0): 1}})
    clock.t += 10
    core.release("c", core.lookup("c", "full", [h(2)]).lease)  # most recent, but no hint
    core.allocate("c", "full", 1)
    assert resident(core) == {h(0), h(1)}


def test_reuse_admission_gate_keeps_one_offs_out_of_dram(make_core):
    core = make_core(policy="reuse", admission="seen-twice", gpu_blocks=1, dram_blocks=2)
    put_chain(core, [0])
    core.release("c", core.lookup("c", "full", [h(0)]).lease)  # seen twice
    settle(core)  # 0 demoted
    put_chain(core, [1])
    settle(core)  # 1 seen once: rejected, dropped
    put_chain(core, [2])
    assert resident(core, Tier.DRAM) == {h(0)}
    s = core.stats()
    assert s["demotions"] == 1 and s["admission_rejects"] == 1


def test_pin_evict_flush(make_core):
    core = make_core(policy="lru", gpu_blocks=2)
    put_chain(core, [0])
    put_chain(core, [1])
    assert core.pin("admin", [h(0)]) == 1
    core.allocate("c", "full", 1)
    assert resident(core) == {h(0)}  # the pinned block survived
    assert core.evict("admin", [h(0)]) == 1 and resident(core) == set()
    core.unpin("admin", [h(0)])
    put_chain(core, [5])
    top = core.top("admin", 5)
    assert [t["hash"] for t in top] == [h(5).hex()] and top[0]["tier"] == "gpu"
    assert core.flush("admin", "dram") == 0
    assert core.flush("admin", "gpu") == 1 and resident(core) == set()


def test_a_session_rereading_its_history_adds_recency_not_frequency(make_core, clock):
    """frequency_per_session: block 0 is re-read three times by its own session (one user), block 1
    once each by three other sessions (three users). Only the other sessions' reads count, so 1 outlives
    0; counting every lookup (the old rule) made 0 the hotter block."""
    def count_after(per_session: bool) -> tuple[float, float]:
        core = make_core(policy="reuse", gpu_blocks=4, frequency_per_session=per_session)
        put_chain(core, [0])
        put_chain(core, [1])
        for b in (0, 1):                                      # each block belongs to a session
            core.release("c", core.lookup("c", "full", [h(b)]).lease, {"session": f"owner{b}"})
        for i in range(3):
            core.release("c", core.lookup("c", "full", [h(0)], session="owner0").lease, {"session": "owner0"})
            core.release("c", core.lookup("c", "full", [h(1)], session=f"other{i}").lease,
                         {"session": f"other{i}"})
        g = core.groups["full"]
        return g.index.get(h(0)).count, g.index.get(h(1)).count

    # both: 1 at commit + 1 for the first, session-less read (the clock stands still: no decay)
    own, shared = count_after(True)
    assert (own, shared) == (2.0, 5.0)                        # the owner's 3 re-reads added nothing
    own, shared = count_after(False)
    assert (own, shared) == (5.0, 5.0)                        # every lookup counted: no difference


def test_reuse_ties_go_leaf_first_whatever_the_release_order(make_core, clock):
    """A session's second turn: its prefix 0-1 comes back through a lookup lease, the new blocks 2-3 through
    a write lease, and the engine releases the lookup lease first. With per-session counts and one expected
    return for the whole turn, all four keys tie; the tie must go to the deepest block (a dropped parent
    strands its children: a hit is a prefix), not to the older heap entry, which was the prefix's tail 1.
    A DRAM tier below, because in the last tier only leaves are candidates anyway; in the GPU tier any block
    is, and a full GPU tier whose cleaner is behind drops its victim at once (a pressure drop)."""
    core = make_core(policy="reuse", gpu_blocks=4, dram_blocks=4)
    hints = {"session": "s", "turn_end": True, "expected_return_s": 30.0}
    first, ids = core.allocate("c", "full", 2)
    core.commit("c", first, [(ids[0], h(0), None), (ids[1], h(1), h(0))])
    core.release("c", first, hints)
    clock.t += 10
    look = core.lookup("c", "full", [h(0), h(1)], session="s")
    write, ids = core.allocate("c", "full", 2)
    core.commit("c", write, [(ids[0], h(2), h(1)), (ids[1], h(3), h(2))])
    core.release("c", look.lease, hints)
    core.release("c", write, hints)
    pol = core.groups["full"].policy
    assert len({pol.key(r) for r in core.groups["full"].index}) == 1          # a tie, as described
    assert [r.hash for r in pol.victims(Tier.GPU, 4)] == [h(3), h(2), h(1), h(0)]
    core.allocate("c", "full", 1)                                             # GPU full: drops one
    assert resident(core) == {h(0), h(1), h(2)} and core.stats()["pressure_drops"] == 1
