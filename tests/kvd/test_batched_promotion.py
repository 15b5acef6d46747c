"""A lease's promotions run as one batch (kvd/promotion.py): right bytes from DRAM and NVMe, runs and
non-runs, one job and one lock trip per lease, a failed read drops only its block, release mid-batch."""
from __future__ import annotations

import threading

import pytest
import torch

from kvd.core_types import KvdError
from kvd.mover import Mover
from kvd.promotion import Promotion, PromotionBatch
from kvd.tiers.base import MemoryPool
from kvd.tiers.nvme import NvmePool
from kvd.tiers import BlockMeta
from kvd.types import Tier
from tests.kvd.conftest import BB, h, put_chain, settle
from tests.kvd.test_tiers import data

CHAIN = list(range(8))


def rec(i: int):
    from kvd.block_index import BlockRecord
    return BlockRecord(h(i), None, 0, Tier.DRAM, i)


def test_batch_copies_runs_and_non_runs_from_dram_and_nvme(tmp_path):
    dram = MemoryPool(Tier.DRAM, torch.stack([data(i) for i in range(8)]), None)    # [8, BB]
    gpu = MemoryPool(Tier.GPU, torch.zeros(16, BB, dtype=torch.uint8), None)         # [16, BB]
    nvme = NvmePool(tmp_path / "nvme", "full", 8, BB)
    nvme.write_many([0, 1, 5], [data(100 + s) for s in (0, 1, 5)], [BlockMeta(h(100 + s), None, 0) for s in (0, 1, 5)])
    # DRAM 0,1,2 -> 3,4,5 (one run); DRAM 6 -> 0 and 4 -> 9 (no run); NVMe 0,1 -> 10,11 (a run) and 5 -> 14
    moves = [(dram, 0, 3), (dram, 1, 4), (dram, 2, 5), (dram, 6, 0), (dram, 4, 9),
             (nvme, 0, 10), (nvme, 1, 11), (nvme, 5, 14)]
    batch = PromotionBatch("full", gpu, [Promotion(rec(i), src, s, d) for i, (src, s, d) in enumerate(moves)])
    batch.run()
    for src, s, d in moves:
        want = data(s) if src is dram else data(100 + s)
        assert torch.equal(gpu.tensor[d], want), (src.tier, s, d)
    assert all(p.error is None for p in batch.items)
    assert set(batch.seconds) == {Tier.DRAM, Tier.NVME}
    assert batch.landed_bytes(Tier.DRAM) == 5 * BB and batch.landed_bytes(Tier.NVME) == 3 * BB
    nvme.close()


def test_failed_nvme_read_fails_only_its_block(tmp_path):
    gpu = MemoryPool(Tier.GPU, torch.zeros(4, BB, dtype=torch.uint8), None)   # [4, BB]
    nvme = NvmePool(tmp_path / "nvme", "full", 4, BB)
    nvme.write_many([0, 1, 2], [data(s) for s in range(3)], [BlockMeta(h(s), None, 0) for s in range(3)])
    real = nvme.read_into

    def flaky(slot, dst):
        if slot == 1:
            raise OSError("bad sector")
        real(slot, dst)

    nvme.read_into = flaky
    batch = PromotionBatch("full", gpu, [Promotion(rec(s), nvme, s, s + 1) for s in range(3)])
    batch.run()
    assert [p.error is None for p in batch.items] == [True, False, True]
    assert torch.equal(gpu.tensor[1], data(0)) and torch.equal(gpu.tensor[3], data(2))
    assert batch.landed_bytes(Tier.NVME) == 2 * BB
    nvme.close()


@pytest.fixture
def mixed(make_core, tmp_path):
    """A chain of 8 blocks: 0-3 in DRAM, 4-7 on NVMe (the cleaner moved them down in the background)."""
    core = make_core(policy="lru-offload", admission="none", gpu_blocks=12, dram_blocks=8, nvme_blocks=16,
                     nvme_dir=tmp_path / "nvme", clean_low=0.5, clean_high=0.5)
    put_chain(core, CHAIN, data=data)
    settle(core)
    put_chain(core, list(range(100, 106)), data=data)
    settle(core)
    g = core.groups["full"]
    assert [g.index.get(h(i)).tier for i in CHAIN] == [Tier.DRAM] * 4 + [Tier.NVME] * 4
    return core


def test_lease_promotes_as_one_batch_with_right_bytes(mixed):
    finished = []
    real = mixed.mover._on_done
    mixed.mover._on_done = lambda b: (finished.append(len(b.items)), real(b))
    res = mixed.lookup("c", "full", [h(i) for i in CHAIN])
    assert not res.ready and len(res.hits) == 8
    assert mixed.wait_ready(res.lease, timeout=5)
    assert finished == [8]   # one job, one finish under the lock, for the lease's 8 blocks
    gpu = mixed.groups["full"].gpu.tensor
    for i, b in zip(CHAIN, res.hits):
        assert torch.equal(gpu[b], data(i)), i
    s = mixed.stats()
    assert s["promotions"] == 8 and s["prefetch_promoted_blocks"] == 8
    mixed.release("c", res.lease)


def test_failure_mid_batch_drops_only_failed_blocks(mixed):
    nvme = mixed.groups["full"].pools[Tier.NVME]
    bad = mixed.groups["full"].index.get(h(5)).slot
    real = nvme.read_into
    nvme.read_into = lambda slot, dst: (_ for _ in ()).throw(OSError("bad sector")) if slot == bad else real(slot, dst)
    res = mixed.lookup("c", "full", [h(i) for i in CHAIN])
    with pytest.raises(KvdError) as err:
        mixed.wait_ready(res.lease, timeout=5)
    assert err.value.code == "promotion_failed"
    g = mixed.groups["full"]
    assert g.index.get(h(5)) is None and g.counters["promotion_errors"] == 1
    gpu = g.gpu.tensor
    for i, b in zip(CHAIN, res.hits):
        if i != 5:
            assert g.index.get(h(i)).tier == Tier.GPU and torch.equal(gpu[b], data(i)), i
    mixed.release("c", res.lease)
    assert mixed.stats()["leases"] == 0


def test_release_during_batch_lands_unleased(mixed):
    res = mixed.lookup("c", "full", [h(i) for i in CHAIN])
    mixed.release("c", res.lease)              # before the inline mover ran the batch
    assert mixed.mover.run_pending() == 1       # runs it now (tick() would also let the cleaner demote)
    g = mixed.groups["full"]
    recs = [g.index.get(h(i)) for i in CHAIN]
    assert all(r.tier == Tier.GPU and r.refs == 0 and not r.moving and r.evictable for r in recs)
    assert all(torch.equal(g.gpu.tensor[r.slot], data(i)) for r, i in zip(recs, CHAIN))
    again = mixed.lookup("c", "full", [h(i) for i in CHAIN])
    assert again.ready and again.hits == [r.slot for r in recs]
    mixed.release("c", again.lease)


def test_cleaner_waits_for_queued_promotions():
    gate, done = threading.Event(), []

    class Slow(PromotionBatch):
        def run(self) -> None:
            gate.wait(5)

    mover = Mover(1, lambda b: done.append(b))
    mover.submit(Slow("full", None, []))        # type: ignore[arg-type]
    assert not mover.wait_idle(0.01)            # a promotion is running: the cleaner would wait
    gate.set()
    assert mover.wait_idle(5) and len(done) == 1 and mover.batches == 1
    mover.close()


def test_reserved_slots_are_paired_into_runs(monkeypatch):
    """GPU slots come off a LIFO free list in descending order; paired in source order they form runs."""
    import kvd.promotion
    dram = MemoryPool(Tier.DRAM, torch.stack([data(i) for i in range(8)]), None)   # [8, BB]
    gpu = MemoryPool(Tier.GPU, torch.zeros(8, BB, dtype=torch.uint8), None)        # [8, BB]
    items = [Promotion(rec(s), dram, s, d) for s, d in zip([4, 5, 6, 7], [3, 2, 1, 0])]
    kvd.promotion.pair_slots(items)
    assert [(p.src_slot, p.dst_slot, p.rec.dest) for p in items] == [(4, 0, 0), (5, 1, 1), (6, 2, 2), (7, 3, 3)]
    copies = []
    real = kvd.promotion.queue_runs
    monkeypatch.setattr(kvd.promotion, "queue_runs", lambda *a: copies.append(real(*a)))
    PromotionBatch("full", gpu, items).run()
    assert copies == [1] and all(torch.equal(gpu.tensor[d], data(d + 4)) for d in range(4))
