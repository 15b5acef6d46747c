"""Background cleaning: the request path never copies, the cleaner keeps each tier's reserve, a block
touched during its demotion stays valid, NVMe batches keep their recovery guarantees, and real threads
committing and looking up while the cleaner runs always read the bytes that were committed."""
from __future__ import annotations

import hashlib
import random
import threading

import pytest
import torch

import kvd.demotion
from kvd.cleaner import Cleaner
from kvd.core_types import KvdError
from kvd.types import Tier
from kvd.watermarks import Watermarks

from tests.kvd.conftest import BB, h, put_chain, settle


def pattern(hash_: bytes) -> torch.Tensor:
    """The bytes a block of hash ``hash_`` must hold wherever it is served from: [BB] uint8."""
    raw = hashlib.blake2b(hash_, digest_size=BB).digest()
    return torch.frombuffer(bytearray(raw), dtype=torch.uint8)


def put(core, ids, parent=None):
    """A chain whose blocks hold ``pattern(hash)``."""
    lease, blocks = core.allocate("c", "full", len(ids))
    g = core.groups["full"]
    items = []
    for b, i in zip(blocks, ids):
        g.gpu.tensor[b].copy_(pattern(h(i)))
        items.append((b, h(i), parent))
        parent = h(i)
    core.commit("c", lease, items)
    core.release("c", lease)


def spy_copies(monkeypatch) -> list[str]:
    """Record the thread of every demotion copy."""
    threads: list[str] = []
    real = kvd.demotion.move_many

    def spy(*args, **kw):
        threads.append(threading.current_thread().name)
        return real(*args, **kw)

    monkeypatch.setattr(kvd.demotion, "move_many", spy)
    return threads


def test_watermarks_hysteresis():
    m = Watermarks(100, 0.03, 0.06)
    assert (m.low, m.high) == (3, 6)
    assert m.want(3) == 0            # at the low mark: nothing yet
    assert m.want(2) == 4            # below it: clean up to the high mark
    assert m.want(4) == 2            # still cleaning until high is reached
    assert m.want(6) == 0 and m.want(5) == 0   # reached high: idle until below low again
    assert Watermarks(2, 0.03, 0.06).low == 1  # at least one block


def test_the_gpu_reserve_holds_a_long_turns_promotion_in_blocks_but_at_most_a_quarter_of_the_tier(make_core, tmp_path):
    # an 8B model's pool: 6% of 2,750 big blocks is 165 slots, fewer than one long turn's ~600-block hit
    assert (Watermarks(2750, 0.03, 0.06, 512).low, Watermarks(2750, 0.03, 0.06, 512).high) == (256, 512)
    assert (Watermarks(11776, 0.03, 0.06, 512).low, Watermarks(11776, 0.03, 0.06, 512).high) == (354, 707)
    assert (Watermarks(64, 0.03, 0.06, 512).low, Watermarks(64, 0.03, 0.06, 512).high) == (8, 16)
    g = make_core(policy="reuse", gpu_blocks=400, dram_blocks=400, nvme_blocks=8, nvme_dir=tmp_path / "n",
                  clean_min_blocks=80).groups["full"]
    # DRAM gets the same floor: it must take a GPU refill's demotions without spilling (an 8-block DRAM with
    # a 1-block reserve under a 2-block GPU reserve spilled 73 of 300 blocks: tests/kvd_io/test_faults.py)
    assert (g.marks[Tier.GPU].high, g.marks[Tier.DRAM].high) == (80, 80)


def test_request_path_drops_instead_of_copying(make_core, monkeypatch):
    core = make_core(policy="lru-offload", gpu_blocks=4, dram_blocks=8)
    copies = spy_copies(monkeypatch)
    put(core, [0, 1, 2, 3])                       # GPU full; nothing ran the (inline) cleaner yet
    core.allocate("c", "full", 2)                 # the request path: a drop per slot, no copy
    assert copies == []
    s = core.stats()
    assert s["pressure_drops"] == 2 and s["groups"]["full"]["pressure_drops"] == 2 and s["demotions"] == 0
    settle(core)                                  # the cleaner (inline here) copies, off the request path
    assert copies and s["lock_wait"]["count"] > 0


def test_cleaner_thread_does_every_copy(make_core, monkeypatch):
    copies = spy_copies(monkeypatch)
    core = make_core(policy="lru-offload", gpu_blocks=32, dram_blocks=64, move_workers=1)
    for i in range(32):
        put(core, [100 + i])
    settle(core)
    g = core.groups["full"]
    marks = g.marks[Tier.GPU]
    # hysteresis: after the last pass the reserve is anywhere from the low mark to the high one (with
    # session 20's floor the marks are 4 and 8 here, and the last puts can leave 6 free without a new pass)
    assert g.gpu.free_count >= marks.low and copies and set(copies) <= {"kvd-cleaner", "MainThread"}
    for rec in g.index:                           # demoted blocks carry their bytes
        pool = g.pools[rec.tier]
        assert torch.equal(pool.tensor[rec.slot], pattern(rec.hash))
    s = core.stats()["groups"]["full"]
    assert s["demote_dram_blocks"] == g.pools[Tier.DRAM].used_count >= marks.low   # as many as the free GPU slots
    assert s["clean_passes"] >= 1 and s["clean_seconds"] > 0 and s["watermarks"]["gpu"]["high_blocks"] == marks.high


def test_lookup_during_demotion_keeps_the_block(make_core, monkeypatch):
    """The copy runs without kvd's lock: a lookup from another thread gets through meanwhile, and the
    demotion then cancels, so the lease reads the GPU slot it was given, with the right bytes."""
    core = make_core(policy="lru-offload", gpu_blocks=2, dram_blocks=4, clean_low=0.99, clean_high=0.99)
    put(core, [0])
    put(core, [1])
    g = core.groups["full"]
    got = {}
    real = kvd.demotion.move_many

    def copy_with_a_concurrent_lookup(*args, **kw):
        monkeypatch.setattr(kvd.demotion, "move_many", real)   # once
        t = threading.Thread(target=lambda: got.setdefault("res", core.lookup("d", "full", [h(0)])))
        t.start()
        t.join(timeout=5)
        assert not t.is_alive(), "the lookup waited for the copy: kvd's lock was held"
        return real(*args, **kw)

    monkeypatch.setattr(kvd.demotion, "move_many", copy_with_a_concurrent_lookup)
    core.tick()
    res = got["res"]
    rec = g.index.get(h(0))
    assert res.tiers == [Tier.GPU] and rec.tier == Tier.GPU and res.hits == [rec.slot]
    assert torch.equal(g.gpu.tensor[res.hits[0]], pattern(h(0)))
    assert g.index.get(h(1)).tier == Tier.DRAM      # the untouched one landed
    s = g.counters
    assert s["demote_cancels"] == 1 and s["demotions"] == 1 and g.pools[Tier.DRAM].used_count == 1
    core.release("d", res.lease)
    settle(core)                                    # released: the next pass moves it after all
    assert rec.tier == Tier.DRAM and torch.equal(g.pools[Tier.DRAM].tensor[rec.slot], pattern(h(0)))


def test_lower_tier_block_being_demoted_is_not_promoted(make_core, tmp_path):
    """A DRAM block on its way to NVMe keeps its DRAM slot until the copy lands: a hit on it is cut
    there (a shorter hit), and a duplicate commit keeps the writer's own copy."""
    core = make_core(policy="lru-offload", admission="none", gpu_blocks=4, dram_blocks=4, nvme_blocks=8,
                     nvme_dir=tmp_path / "nvme")
    g = core.groups["full"]
    put(core, [0, 1])                               # released tail first: 1 is the LRU victim everywhere
    jobs = g.plan_demotions(Tier.GPU, 2)            # by hand: both to DRAM
    core._finish_batch(g, jobs, None, kvd.demotion.Demotion.run_batch(jobs))
    assert [g.index.get(h(i)).tier for i in (0, 1)] == [Tier.DRAM, Tier.DRAM]
    (job,) = g.plan_demotions(Tier.DRAM, 1)         # 1 to NVMe: planned, copy not run yet
    assert job.rec.hash == h(1) and job.rec.demoting
    res = core.lookup("c", "full", [h(0), h(1)])
    assert res.tiers == [Tier.DRAM]                 # 0 is promoted, the hit is cut before 1
    lease, (mine,) = core.allocate("d", "full", 1)
    g.gpu.tensor[mine].copy_(pattern(h(1)))
    assert core.commit("d", lease, [(mine, h(1), h(0))]) == [mine]   # private: 1's DRAM slot is being read
    assert mine in core._leases.get("d", lease).writes
    core._finish_batch(g, [job], None, kvd.demotion.Demotion.run_batch([job]))
    # the lookup saw 1 (then cut it): a looked-up block stays where it is; the NVMe slot is given back
    assert job.rec.tier == Tier.DRAM and g.index.get(h(1)) is job.rec and not job.rec.demoting
    assert g.counters["demote_cancels"] == 1 and g.pools[Tier.NVME].used_count == 0
    assert core.wait_ready(res.lease, timeout=5)
    assert torch.equal(g.gpu.tensor[res.hits[0]], pattern(h(0)))


def test_nvme_batch_is_one_index_append_and_recovers(make_core, tmp_path):
    kw = {"policy": "lru-offload", "gpu_blocks": 8, "nvme_blocks": 16, "nvme_dir": tmp_path / "nvme",
          "clean_low": 0.99, "clean_high": 0.99, "clean_batch": 8}
    core = make_core(**kw)
    nvme = core.groups["full"].pools[Tier.NVME]
    appends = []
    real = nvme._index.write
    nvme._index = type("Spy", (), {"write": lambda self, b: appends.append(len(b)) or real(b),
                                   "close": lambda self: None})()
    put(core, list(range(8)))
    settle(core)
    assert len(appends) == 1 and core.stats()["demote_nvme_blocks"] == 8   # eight entries, one write
    second = make_core(**kw)                        # a crash: no close(); every entry re-verified
    assert second.stats()["groups"]["full"]["nvme_recovered"] == 8
    for i in range(8):
        res = second.lookup("c", "full", [h(j) for j in range(i + 1)])
        assert second.wait_ready(res.lease, timeout=10)
        assert torch.equal(second.groups["full"].gpu.tensor[res.hits[i]], pattern(h(i)))
        second.release("c", res.lease)
        settle(second)


def test_pressure_wait_lets_the_cleaner_free_a_slot(make_core):
    """pressure_wait_ms > 0: a request on a full tier waits (lock released) for the cleaner instead of
    dropping. The cleaner thread is started only once the tier is full, so the request must wait."""
    core = make_core(policy="lru-offload", gpu_blocks=8, dram_blocks=16, pressure_wait_ms=5000)
    put(core, list(range(8)))
    core.cleaner = Cleaner(True, core.clean)        # closed by make_core's teardown (core.close)
    core.groups["full"].wake = core.cleaner.wake
    core.allocate("c", "full", 1)
    s = core.stats()["groups"]["full"]
    assert s["pressure_drops"] == 0 and s["pressure_waits"] == 1 and s["demotions"] >= 1


def test_full_dram_spills_so_the_gpu_reserve_never_waits_for_nvme(make_core, tmp_path, monkeypatch):
    """Top-down cleaning. A full DRAM tier makes room for a GPU victim by dropping its own victim
    (spill_drops) instead of waiting for its DRAM→NVMe writes, and when both tiers are short the
    cleaner's next batch is the GPU tier's (what allocations need), not DRAM's NVMe writes."""
    core = make_core(policy="lru-offload", gpu_blocks=8, dram_blocks=4, nvme_blocks=32, nvme_dir=tmp_path / "nvme",
                     clean_low=0.99, clean_high=0.99, clean_batch=2)
    g = core.groups["full"]
    real_want = g.clean_want
    monkeypatch.setattr(g, "clean_want", lambda tier: 0 if tier is Tier.DRAM else real_want(tier))  # DRAM never cleans
    for i in range(7):
        put(core, [100 + i])
        settle(core)
    s = core.stats()["groups"]["full"]
    assert g.pools[Tier.DRAM].free_count == 0 and g.pools[Tier.GPU].free_count == 8   # every GPU block demoted
    assert s["spill_drops"] == 3 and s["pressure_drops"] == 0 and s.get("demote_nvme_blocks", 0) == 0
    assert s["demote_dram_blocks"] == 7
    # the four most recent blocks are the ones kept (LRU), in DRAM
    assert [g.index.get(h(100 + i)) is not None for i in range(7)] == [False] * 3 + [True] * 4

    monkeypatch.setattr(g, "clean_want", real_want)     # now both tiers are short of their reserve
    put(core, [200])
    batch = core._plan_batch(g)
    assert batch and {(j.src.tier, j.dst.tier) for j in batch} == {(Tier.GPU, Tier.DRAM)}
    core._finish_batch(g, batch, None, 0.0)


@pytest.mark.parametrize("skip", [True, False])
def test_nvme_is_written_only_while_promoting_from_it_beats_recomputing(make_core, tmp_path, skip):
    """CacheGroup.nvme_pays: once a lookup names a recompute price below what an NVMe promotion of a block is
    predicted to cost, DRAM's victims are dropped (nvme_unpaid_drops) instead of written to NVMe; a higher
    price turns the writes back on. ``skip_unpaid_nvme=False`` writes whatever the price."""
    core = make_core(policy="lru-offload", gpu_blocks=8, dram_blocks=4, nvme_blocks=32, nvme_dir=tmp_path / "nvme",
                     clean_low=0.99, clean_high=0.99, clean_batch=2, skip_unpaid_nvme=skip)
    g = core.groups["full"]
    nvme_s = core.rates.seconds(Tier.NVME, BB)
    core.lookup("c", "full", [h(999)], recompute_s=nvme_s / 2)      # recomputing a block is the cheaper way
    for i in range(16):
        put(core, [100 + i])
        settle(core)
    s = core.stats()["groups"]["full"]
    assert s["nvme_pays"] is (not skip)
    if skip:
        assert s.get("demote_nvme_blocks", 0) == 0 and s["nvme_unpaid_drops"] > 0 and s["spill_drops"] == 0
        assert g.pools[Tier.NVME].free_count == 32
    else:
        assert s["demote_nvme_blocks"] > 0 and s["nvme_unpaid_drops"] == 0

    core.lookup("c", "full", [h(999)], recompute_s=nvme_s * 2)      # now an NVMe block saves time
    assert core.stats()["groups"]["full"]["nvme_pays"] is True
    before = core.stats()["groups"]["full"].get("demote_nvme_blocks", 0)
    for i in range(16):
        put(core, [300 + i])
        settle(core)
    assert core.stats()["groups"]["full"]["demote_nvme_blocks"] > before


@pytest.mark.parametrize("policy", ["lru-offload", "reuse"])
def test_threads_commit_and_look_up_while_the_cleaner_runs(make_core, tmp_path, policy):
    """Every hit's bytes equal what was committed under its hash, whatever tier it came from."""
    core = make_core(policy=policy, admission="none", gpu_blocks=24, dram_blocks=24, nvme_blocks=48,
                     nvme_dir=tmp_path / "nvme", move_workers=1, clean_low=0.1, clean_high=0.2, clean_batch=4)
    g = core.groups["full"]
    bad: list[str] = []
    hits = [0]
    stop = threading.Event()

    def worker(seed: int) -> None:
        rng = random.Random(seed)
        client = f"w{seed}"
        while not stop.is_set():
            chain = [seed * 1000 + rng.randrange(40) * 4 + k for k in range(rng.randrange(1, 4))]
            try:
                res = core.lookup(client, "full", [h(i) for i in chain])
                core.wait_ready(res.lease, timeout=10)
                for b, i in zip(res.hits, chain):
                    if not torch.equal(g.gpu.tensor[b], pattern(h(i))):
                        bad.append(f"block {i} at slot {b}")
                hits[0] += len(res.hits)
                core.release(client, res.lease)
                rest = chain[len(res.hits):]
                if rest:
                    lease, blocks = core.allocate(client, "full", len(rest))
                    parent = h(chain[len(res.hits) - 1]) if res.hits else None
                    items = []
                    for b, i in zip(blocks, rest):
                        g.gpu.tensor[b].copy_(pattern(h(i)))
                        items.append((b, h(i), parent))
                        parent = h(i)
                    core.commit(client, lease, items)
                    core.release(client, lease)
            except KvdError as e:
                if e.code not in ("out_of_blocks", "bad_chain"):
                    bad.append(repr(e))
            except Exception as e:  # noqa: BLE001 - a dead worker must fail the test, not stall it
                bad.append(repr(e))
                return

    threads = [threading.Thread(target=worker, args=(s,)) for s in (1, 2)]
    for t in threads:
        t.start()
    for _ in range(300):   # until enough happened (at most 15 s on a loaded machine)
        s = core.stats()
        if hits[0] > 50 and s["demotions"] > 20 and s["promotions"] > 0 and s["demote_nvme_blocks"] > 0:
            break
        stop.wait(0.05)
    stop.set()
    for t in threads:
        t.join(timeout=30)
    s = core.stats()
    assert bad == []
    assert hits[0] > 50, (hits, s)
    assert s["demotions"] > 20 and s["promotions"] > 0 and s["demote_nvme_blocks"] > 0


def test_a_batch_lands_in_slot_order_so_a_chain_stays_one_run():
    """Victims in policy order (here reversed and interleaved) still land ascending in the lower tier:
    reserved destinations are re-paired with sources in slot order, so the batch is one copy run."""
    from kvd.cache_group import pair_in_slot_order
    from kvd.demotion import Demotion
    from kvd.tiers.base import slot_runs

    src_slots = [7, 3, 5, 4, 6]                      # the order the policy picked them
    dst_slots = [20, 21, 22, 23, 24]                 # reserved one by one, lowest first
    jobs = [Demotion(rec=None, src=None, src_slot=s, dst=None, dst_slot=d, sightings=0)
            for s, d in zip(src_slots, dst_slots)]
    paired = pair_in_slot_order(jobs)
    assert [j.src_slot for j in paired] == src_slots                # the policy's order is kept
    copied = sorted(paired, key=lambda j: j.src_slot)                 # the order run_batch copies in
    assert [(j.src_slot, j.dst_slot) for j in copied] == [(3, 20), (4, 21), (5, 22), (6, 23), (7, 24)]
    assert len(slot_runs([j.dst_slot for j in copied], [j.src_slot for j in copied])) == 1
    assert len(slot_runs(dst_slots, src_slots)) > 1          # as reserved, it was several copies
