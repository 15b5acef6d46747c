"""Prefetch budget: a lookup promotes lower-tier blocks only where that is predicted faster than the
client recomputing them (kvd/prefetch_budget.py), from tier rates measured per copy (kvd/tier_rates.py)."""
from __future__ import annotations

import pytest

from kvd.prefetch_budget import best_cut
from kvd.tier_rates import RATE_EWMA, TierRates
from kvd.types import Tier

from tests.kvd.conftest import BB, h, put_chain, settle


def test_best_cut_rule():
    cands = [0, 1, 2, 3, 4]
    assert best_cut(cands, [0, 0, 0, 5, 10], None) == 4            # no budget: the longest hit
    assert best_cut(cands, [0, 0, 0, 5, 10], 1.0) == 2             # blocks 2, 3 cost 5 s each > 1 s
    assert best_cut(cands, [0, 0, 0, 5, 10], 5.0) == 4             # a tie goes to the cache
    assert best_cut(cands, [0, 3, 3, 3, 3], 1.0) == 4              # one costly block, then free ones: 4 - 3 > 0
    assert best_cut([0, 4], [0, 9], 2.0) == 0                      # only whole servable ends are candidates


def test_rates_are_an_ewma_of_observed_copies():
    r = TierRates(dram_bps=1e9, nvme_bps=1e8)
    assert r.seconds(Tier.GPU, 10**9) == 0 and r.seconds(Tier.NVME, 10**8) == pytest.approx(1.0)
    r.observe(Tier.NVME, 10**6, 1e-3)                              # a 1 GB/s copy
    assert r.bps[Tier.NVME] == pytest.approx((1 - RATE_EWMA) * 1e8 + RATE_EWMA * 1e9)


def fill(core):
    """The chain 0..5 through a 4-block GPU pool: the oldest part, 0 and 1, is demoted to NVMe (the
    cleaner keeps 2 of the 4 GPU slots free)."""
    put_chain(core, [0, 1])
    put_chain(core, [2, 3], parent=h(1))
    settle(core)
    put_chain(core, [4, 5], parent=h(3))


def test_slow_nvme_is_recomputed_fast_nvme_is_promoted(make_core, tmp_path):
    core = make_core(policy="lru-offload", gpu_blocks=4, dram_blocks=0, nvme_blocks=8, nvme_dir=tmp_path / "nvme",
                     clean_low=0.5, clean_high=0.5)
    fill(core)
    full = core.groups["full"]
    assert [full.index.get(h(i)).tier for i in range(6)] == [Tier.NVME] * 2 + [Tier.GPU] * 4
    hashes = [h(i) for i in range(4)]                     # a hit of 4 fits the GPU pool (4 and 5 move down)
    core.rates.bps[Tier.NVME] = BB / 10.0                 # 10 s per block: slower than recomputing
    res = core.lookup("c", "full", hashes, recompute_s=0.01)
    assert res.hits == [] and res.lease == 0                # the NVMe head is needed by every longer hit
    st = core.stats()
    assert st["prefetch_recompute_lookups"] == 1 and st["prefetch_recompute_blocks"] == 4
    assert st["prefetch_promoted_blocks"] == 0
    core.rates.bps[Tier.NVME] = BB / 1e-4                 # 0.1 ms per block: promote
    res = core.lookup("c", "full", hashes, recompute_s=0.01)
    assert len(res.hits) == 4 and res.tiers == [Tier.NVME] * 2 + [Tier.GPU] * 2
    assert core.wait_ready(res.lease, timeout=5)
    st = core.stats()
    assert st["prefetch_promoted_blocks"] == 2 and st["prefetch_recompute_lookups"] == 1
    assert st["promote_nvme_bps"] != BB / 1e-4            # the measured copies moved the estimate
    core.release("c", res.lease)


def test_queued_promotions_count_in_the_budget(make_core, tmp_path):
    """A promotion waits for those queued before it: with a backlog longer than recomputing, the same
    lookup that promotes on an idle mover recomputes; the backlog drains as batches finish."""
    core = make_core(policy="lru-offload", gpu_blocks=4, dram_blocks=0, nvme_blocks=8, nvme_dir=tmp_path / "nvme",
                     clean_low=0.5, clean_high=0.5)
    fill(core)
    hashes = [h(i) for i in range(4)]
    core.rates.bps[Tier.NVME] = BB / 1e-4                 # 0.1 ms per block: promoting 2 blocks beats 4 × 10 ms
    core._backlog_s = 1.0                                 # but a second of promotions is queued ahead
    res = core.lookup("c", "full", hashes, recompute_s=0.01)
    assert res.hits == [] and core.stats()["prefetch_recompute_blocks"] == 4
    core._backlog_s = 0.0
    res = core.lookup("c", "full", hashes, recompute_s=0.01)
    assert len(res.hits) == 4
    assert core.stats()["promotion_backlog_s"] == pytest.approx(2e-4)   # this lookup's own batch, queued
    assert core.wait_ready(res.lease, timeout=5)
    assert core.stats()["promotion_backlog_s"] == 0.0                  # landed: nothing queued
    core.release("c", res.lease)


def test_no_budget_keeps_the_old_behaviour(make_core, tmp_path):
    core = make_core(policy="lru-offload", gpu_blocks=4, dram_blocks=0, nvme_blocks=8, nvme_dir=tmp_path / "nvme",
                     clean_low=0.5, clean_high=0.5)
    fill(core)
    core.rates.bps[Tier.NVME] = 1.0                      # absurdly slow, but no recompute_s was sent
    res = core.lookup("c", "full", [h(i) for i in range(4)])
    assert len(res.hits) == 4 and core.stats()["prefetch_recompute_lookups"] == 0
    core.wait_ready(res.lease, timeout=5)
    core.release("c", res.lease)
