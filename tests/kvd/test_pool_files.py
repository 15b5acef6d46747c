"""Pool files of dead kvd processes are removed at the next start; a live owner's never are."""
import os
import signal
import subprocess
import sys
import time

from kvd.config import KvdConfig
from kvd.core import KvdCore
from kvd.tiers import pool_files
from kvd.tiers.base import shm_dir


def test_unlocked_pool_files_are_reaped_and_held_ones_kept(tmp_path):
    stale = tmp_path / "kvd-999999-abc-full-dram.pool"
    stale.write_bytes(b"x" * 64)
    live = tmp_path / "kvd-1-def-full-dram.pool"
    live.write_bytes(b"y" * 64)
    other = tmp_path / "not-a-pool.bin"
    other.write_bytes(b"z")
    fd = pool_files.hold(live)
    try:
        assert pool_files.reap_stale(tmp_path) == [stale]
        assert live.exists() and other.exists() and not stale.exists()
    finally:
        os.close(fd)
    assert pool_files.reap_stale(tmp_path) == [live]        # its owner is gone now


def test_a_killed_owner_leaves_a_file_the_next_kvd_removes(tmp_path):
    path = tmp_path / "kvd-4242-0-full-dram.pool"
    path.write_bytes(b"\0" * 4096)
    child = subprocess.Popen([sys.executable, "-c", (
        "import sys, time; from pathlib import Path; from kvd.tiers import pool_files; "
        f"pool_files.hold(Path({str(path)!r})); print('held', flush=True); time.sleep(60)")],
        stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout.readline().strip() == "held"
        assert pool_files.reap_stale(tmp_path) == []         # alive: kept
        child.send_signal(signal.SIGKILL)
        child.wait(timeout=10)
        assert pool_files.reap_stale(tmp_path) == [path]
    finally:
        if child.poll() is None:
            child.kill()


def test_kvd_core_reaps_at_start_and_keeps_its_own_pools(tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    cfg = KvdConfig(run_dir=run, gpu_blocks=2, dram_blocks=2, move_workers=0)
    first = KvdCore(cfg)
    first.attach("c", "full", 64)
    mine = sorted(shm_dir(run).glob(f"{first._tag}-*.pool"))
    assert mine                                             # a shm GPU fallback pool and a DRAM pool
    dead = shm_dir(run) / "kvd-999999-dead-full-dram.pool"
    dead.write_bytes(b"\0" * 64)
    second = KvdCore(cfg)                                   # a second kvd starting on the same machine
    try:
        assert not dead.exists()
        assert all(p.exists() for p in mine)                # the live first kvd's pools survive
    finally:
        second.close()
        first.close()
    assert not any(p.exists() for p in mine)                # a clean close removes them
