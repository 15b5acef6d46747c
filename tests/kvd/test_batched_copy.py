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


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("to_gpu", [True, False], ids=["host-to-gpu", "gpu-to-host"])
def test_batched_copies_on_the_gpu_equal_the_reference_loop(to_gpu):
    """Both directions between pinned host memory and the GPU, as kvd's promotions and demotions issue them
    (non-blocking, one foreach call), move the same bytes as the loop once the stream is waited for."""
    from kvd.tiers.base import wait_stream
    rng = random.Random(7)
    n, bb = 96, 4096
    host = torch.randint(0, 256, (n, bb), dtype=torch.uint8).pin_memory()
    gpu = torch.randint(0, 256, (n, bb), dtype=torch.uint8, device="cuda")
    src, make_dst = (host, lambda: torch.zeros(n, bb, dtype=torch.uint8, device="cuda")) if to_gpu else \
        (gpu, lambda: torch.zeros(n, bb, dtype=torch.uint8).pin_memory())
    src_slots = [i for st in rng.sample(range(0, n, 8), 6) for i in range(st, st + 8)]   # runs of 8, shuffled
    dst_slots = [i for st in rng.sample(range(0, n, 8), 6) for i in range(st, st + 8)]
    dst_slots[3:5] = dst_slots[4], dst_slots[3]                                           # and some single blocks
    want, got = make_dst(), make_dst()
    queue_runs_reference(want, dst_slots, src, src_slots)
    queue_batched(got, src, slot_runs(dst_slots, src_slots), non_blocking=True)
    wait_stream(got, src)
    assert torch.equal(got.cpu(), want.cpu())
    for d, s in zip(dst_slots, src_slots):
        assert torch.equal(got[d].cpu(), src[s].cpu())
