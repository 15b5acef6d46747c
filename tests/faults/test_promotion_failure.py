"""A promotion whose copy fails: kvd drops the block, and whoever holds a lease on it must hear so
(``wait_ready`` raises ``promotion_failed``) instead of reading a GPU slot that never received the bytes.
specd's reaction (recompute) is tested in tests/engine/test_parked_admission.py."""
from __future__ import annotations

import pytest

import kvd.promotion
from kvd.config import KvdConfig
from kvd.core import KvdCore
from kvd.core_types import KvdError
from kvd.types import Tier
from tests.kvd.conftest import BB, h, put_chain, settle


@pytest.fixture
def core(tmp_path):
    c = KvdCore(KvdConfig(run_dir=tmp_path / "run", policy="lru-offload", gpu_blocks=4, dram_blocks=8,
                          move_workers=0, clean_low=0.5, clean_high=0.5))
    c.attach("c", "full", BB)
    put_chain(c, [0, 1])
    put_chain(c, [2, 3], parent=h(1))
    settle(c)
    put_chain(c, [4, 5], parent=h(3))
    assert c.groups["full"].index.get(h(0)).tier == Tier.DRAM
    yield c
    c.close()


def test_failed_promotion_is_reported_not_served(core, monkeypatch):
    def broken(*_a, **_k):
        raise OSError("copy failed")
    monkeypatch.setattr(kvd.promotion, "queue_runs", broken)
    res = core.lookup("c", "full", [h(0), h(1)])
    assert len(res.hits) == 2 and not res.ready
    with pytest.raises(KvdError) as err:
        core.wait_ready(res.lease, timeout=5)
    assert err.value.code == "promotion_failed"
    assert core.stats()["groups"]["full"]["promotion_errors"] == 2
    core.release("c", res.lease)


def test_landed_promotion_is_ready(core):
    res = core.lookup("c", "full", [h(0), h(1)])
    assert not res.ready and core.wait_ready(res.lease, timeout=5)
    core.release("c", res.lease)
