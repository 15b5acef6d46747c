"""Bytes through every tier, persistence across a crash, disk-full degradation."""
import errno
import logging

import pytest
import torch

from kvd.types import Tier

from tests.kvd.conftest import BB, h, put_chain, settle


def data(i: int) -> torch.Tensor:
    return torch.randint(0, 256, (BB,), dtype=torch.uint8, generator=torch.Generator().manual_seed(i))


def tiered(make_core, tmp_path, **kw):
    kw = {"policy": "reuse", "admission": "none", "gpu_blocks": 1, "dram_blocks": 1,
          "nvme_blocks": 2, "nvme_dir": tmp_path / "nvme", **kw}
    return make_core(**kw)


def where(core, i):
    r = core.groups["full"].index.get(h(i))
    return None if r is None else r.tier


@pytest.mark.parametrize("workers", [0, 1])
def test_bytes_round_trip_gpu_dram_nvme_gpu(make_core, tmp_path, workers):
    # DRAM keeps one of its two slots free (a 1-block tier with a reserve would always be empty)
    core = tiered(make_core, tmp_path, move_workers=workers, dram_blocks=2, clean_low=0.5, clean_high=0.5)
    for i in range(3):
        put_chain(core, [i], data=data)
        settle(core)   # the cleaner keeps one free slot per tier: each block moves down in the background
    assert [where(core, i) for i in range(3)] == [Tier.NVME, Tier.NVME, Tier.DRAM]
    res = core.lookup("c", "full", [h(0)])  # promote from NVMe into the GPU's free reserve slot
    assert res.tiers == [Tier.NVME]
    if workers == 0:
        assert not res.ready
    assert core.wait_ready(res.lease, timeout=10)
    gpu = core.groups["full"].gpu.tensor
    assert torch.equal(gpu[res.hits[0]], data(0))
    core.release("c", res.lease)
    for i in (1, 2):  # and the others came back down intact
        settle(core)
        res = core.lookup("c", "full", [h(i)])
        assert core.wait_ready(res.lease, timeout=10)
        assert torch.equal(gpu[res.hits[0]], data(i))
        core.release("c", res.lease)
    s = core.stats()
    assert s["promotions"] == 3 and s["demotions"] >= 5


def fill_nvme(core, n):
    for i in range(n):
        settle(core)   # the previous block goes down to NVMe in the background
        put_chain(core, [i], data=data)


def test_persistence_survives_crash_and_drops_corrupt_entry(make_core, tmp_path):
    nvme_dir = tmp_path / "nvme"
    kw = {"policy": "reuse", "admission": "none", "gpu_blocks": 1, "nvme_blocks": 4, "nvme_dir": nvme_dir}
    first = make_core(**kw)
    fill_nvme(first, 4)  # 0, 1, 2 on NVMe; 3 on the GPU (lost with the process)
    slot1 = first.groups["full"].index.get(h(1)).slot
    # crash: no close(); corrupt one block's bytes on disk and tear the index tail
    with open(nvme_dir / "full.slab", "r+b") as f:
        f.seek(slot1 * BB + 7)
        f.write(b"\xff\x00\xff")
    with open(nvme_dir / "full.idx", "ab") as f:
        f.write(b"torn entry")
    second = make_core(**kw)
    s = second.stats()["groups"]["full"]
    assert s["nvme_recovered"] == 2 and s["nvme_dropped_on_recovery"] == 1
    assert [where(second, i) for i in range(4)] == [Tier.NVME, None, Tier.NVME, None]
    assert second.lookup("c", "full", [h(1)]).hits == []  # never served under its hash
    for i in (0, 2):
        res = second.lookup("c", "full", [h(i)])
        assert second.wait_ready(res.lease, timeout=10)
        assert torch.equal(second.groups["full"].gpu.tensor[res.hits[0]], data(i))
        second.release("c", res.lease)


def test_recovery_rejects_other_geometry(make_core, tmp_path):
    kw = {"policy": "reuse", "admission": "none", "gpu_blocks": 1, "nvme_blocks": 4, "nvme_dir": tmp_path / "n"}
    fill_nvme(make_core(**kw), 3)
    other = make_core(**kw)
    assert other.stats()["groups"]["full"]["nvme_recovered"] == 2
    other.close()
    from kvd.tiers.nvme import NvmePool
    pool = NvmePool(tmp_path / "n", "full", 4, BB * 2)  # another block size: nothing reinterpreted
    assert pool.recovered == []
    pool.close()


def test_disk_full_degrades_nvme(make_core, tmp_path, caplog):
    core = make_core(policy="reuse", admission="none", gpu_blocks=1, nvme_blocks=4, nvme_dir=tmp_path / "nvme")
    calls = []

    def full(fd, data, off):
        calls.append(off)
        raise OSError(errno.ENOSPC, "No space left on device")

    core.groups["full"].pools[Tier.NVME]._pwrite = full
    with caplog.at_level(logging.WARNING, logger="kvd.cache_group"):
        for i in range(4):
            put_chain(core, [i])
            settle(core)  # the cleaner would move each block to NVMe
    assert len(calls) == 1  # tried once, then the tier stopped admitting
    s = core.stats()
    assert s["nvme_degraded"] and s["nvme_enospc"] == 1 and s["evictions"] == 3
    assert sum("degraded" in r.message for r in caplog.records) == 1
    assert where(core, 3) == Tier.GPU and len(core.groups["full"].index) == 1


def test_freed_slots_come_back_lowest_first_so_batches_copy_as_runs():
    """A chain's slots freed in order are handed out ascending again (a LIFO list reversed them), so
    a batch of them pairs with an ascending source run as one copy, not one copy per block."""
    from kvd.tiers.base import MemoryPool, slot_runs

    pool = MemoryPool(Tier.DRAM, torch.zeros(16, 4, dtype=torch.uint8), None)
    taken = [pool.alloc() for _ in range(12)]
    assert taken == list(range(12))
    for s in (4, 5, 6, 7):
        pool.free(s)
    again = [pool.alloc() for _ in range(4)]
    assert again == [4, 5, 6, 7]
    assert len(slot_runs(again, [20, 21, 22, 23])) == 1
