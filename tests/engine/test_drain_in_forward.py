"""Answers taken while a forward runs (KvdBlockSource.drain_in_forward): a duplicate commit's table switch
happens then, but the writer's own slot, which the running forward may still read, goes back to kvd only
after the forward (``after_forward``). Against a real kvd process."""
from __future__ import annotations

import time

import pytest
import torch

from bench.kvd_process import KvdProcess
from client.kvd_client import KvdClient
from kvd.hashing import block_hash, namespace_root
from specd.engine.kv_layout import KVLayout
from specd.engine.kvd_source import KvdBlockSource

pytestmark = pytest.mark.slow

LAYOUT = KVLayout(num_layers=2, block_size=4, num_kv_heads=1, head_dim=8, dtype=torch.float32)


def arrived(source: KvdBlockSource) -> None:
    """Wait until every posted answer is on the socket (not handed out)."""
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline:
        with source.client._lock:
            source.client._read_ready()
            if all(i in source.client._arrived for i in source.client._posted):
                return
        time.sleep(0.01)
    raise AssertionError("kvd did not answer")


def test_duplicate_slot_goes_back_only_after_the_forward(tmp_path):
    with KvdProcess(tmp_path / "kvd", gpu_bytes=64 * LAYOUT.block_bytes, dram_bytes=0, max_groups=1) as kvd:
        source = KvdBlockSource.connect(kvd.run_dir, LAYOUT, torch.device("cpu"))
        h0 = block_hash(namespace_root("m", "t", "f32", "l", 4), [1, 2, 3, 4])
        first, (a,) = source.allocate(1)
        source.commit(first, [(a, h0, None)], on_done=lambda out: None)       # published
        arrived(source)
        source.drain()
        second, (b,) = source.allocate(1)
        switched = []
        source.commit(second, [(b, h0, None)], on_done=switched.append)       # a duplicate: canonical is a
        arrived(source)
        source.drain_in_forward()
        assert switched == [[a]]                           # the table switch happened in the forward window
        assert b in source._held[second][1]                # but our own slot is still ours
        def writes(lease):
            with KvdClient(kvd.run_dir) as admin:
                return next(l["writes"] for l in admin.leases() if l["lease"] == lease)
        assert writes(second) == 1                         # kvd still leases our slot to us
        source.after_forward()
        assert b not in source._held[second][1]            # given back once the forward is over
        source.settle()
        assert writes(second) == 0                         # and kvd has it back
        source.release([first, second])
        source.close()


def test_a_lease_released_before_the_forward_ends_keeps_nothing_to_give_back(tmp_path):
    with KvdProcess(tmp_path / "kvd", gpu_bytes=64 * LAYOUT.block_bytes, dram_bytes=0, max_groups=1) as kvd:
        source = KvdBlockSource.connect(kvd.run_dir, LAYOUT, torch.device("cpu"))
        h0 = block_hash(namespace_root("m", "t", "f32", "l", 4), [5, 6, 7, 8])
        first, (a,) = source.allocate(1)
        source.commit(first, [(a, h0, None)], on_done=lambda out: None)
        second, (b,) = source.allocate(1)
        source.commit(second, [(b, h0, None)], on_done=lambda out: None)
        arrived(source)
        source.drain_in_forward()
        source.release([second])                           # the sequence finished in the output phase
        source.after_forward()                             # nothing left to give back, no error
        source.settle()
        assert second not in source._held
        source.release([first])
        source.close()
