"""The copy path's batched issue (kvd/tiers/base.py ``queue_batched``, one foreach call for every run of a
batch) moves the same bytes as the per-run reference loop; the daemon sets its GIL switch interval."""
from __future__ import annotations

import random

import pytest
import torch

from kvd.config import KvdConfig
from kvd.tiers.base import queue_batched, queue_runs, queue_runs_reference, slot_runs


@pytest.mark.parametrize("seed", range(5))
def test_batched_copies_equal_the_reference_loop(seed):
    rng = random.Random(seed)
    n, bb = 64, 32
    src = torch.randint(0, 256, (n, bb), dtype=torch.uint8)
    k = rng.randint(1, n)
    src_slots = rng.sample(range(n), k)
    dst_slots = sorted(rng.sample(range(n), k)) if seed % 2 else rng.sample(range(n), k)
    src_slots = sorted(src_slots) if seed % 3 == 0 else src_slots      # some cases with long runs
    want, got = torch.zeros(n, bb, dtype=torch.uint8), torch.zeros(n, bb, dtype=torch.uint8)
    n_ref = queue_runs_reference(want, dst_slots, src, src_slots)
    n_fast = queue_batched(got, src, slot_runs(dst_slots, src_slots))
    assert n_ref == n_fast and torch.equal(got, want)
    for d, s in zip(dst_slots, src_slots):
        assert torch.equal(got[d], src[s])
    again = torch.zeros(n, bb, dtype=torch.uint8)
    assert queue_runs(again, dst_slots, src, src_slots) == n_ref and torch.equal(again, want)   # CPU: the loop


def test_gil_switch_interval_is_validated_and_a_daemon_flag():
    assert KvdConfig(run_dir="/tmp/x").gil_switch_ms == 0.5
    with pytest.raises(ValueError):
        KvdConfig(run_dir="/tmp/x", gil_switch_ms=0)
    from kvd.__main__ import build_parser
    assert "--gil-switch-ms" in build_parser().format_help()
