"""A real kvd process end to end over IPC: the data plane through the mapped pool, kvctl against it,
one daemon per run dir, clean shutdown on SIGTERM."""
from __future__ import annotations

import json
import os
import stat
import subprocess
import sys

import pytest

from bench.kvd_process import KvdProcess
from client.kvd_client import BadChain, KvdClient, map_pool
from kvd_blocks import BLOCK_BYTES, chain_of, commit_chain, served_bytes_match

pytestmark = pytest.mark.slow


def test_data_plane_and_kvctl(kvd_factory):
    kvd = kvd_factory(gpu_blocks=32, dram_blocks=0, nvme_blocks=0)
    for name in ("kvd.sock", "kvd-admin.sock"):
        assert stat.S_IMODE(os.stat(kvd.run_dir / name).st_mode) == 0o660
    with KvdClient(kvd.run_dir) as c:
        info = c.attach("full", BLOCK_BYTES)
        pool = map_pool(info)
        assert tuple(pool.shape) == (info.gpu_blocks, BLOCK_BYTES)
        chain = chain_of(1, 6)
        commit_chain(c, pool, chain[:4])
        assert served_bytes_match(c, pool, chain) == 4  # longest present prefix
        lease, blocks = c.allocate("full", 1)
        with pytest.raises(BadChain):
            c.commit(lease, [(blocks[0], chain_of(2, 1)[0], chain_of(3, 1)[0])])  # parent never committed
        c.release(lease)
        assert c.lookup("full", chain_of(3, 2)).num_hits == 0
    run = [sys.executable, "-m", "client.kvctl", "--run-dir", str(kvd.run_dir)]
    out = subprocess.run(run + ["stats", "--json"], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    stats = json.loads(out.stdout)  # exactly one JSON object
    assert isinstance(stats, dict) and stats
    # the daemon froze its start-up heap out of the collector (KvdConfig.gc_freeze) and counts the passes
    assert stats["server"]["gc"]["gc_frozen_objects"] > 1000
    assert {f"gc_gen{g}_passes_total" for g in range(3)} <= set(stats["server"]["gc"])
    table = subprocess.run(run + ["stats"], capture_output=True, text=True, timeout=60)
    assert table.returncode == 0 and "counter" in table.stdout
    for cmd in (["top", "--json"], ["leases", "--json"], ["sessions", "--json"], ["flush", "--json"]):
        res = subprocess.run(run + cmd, capture_output=True, text=True, timeout=60)
        assert res.returncode == 0, (cmd, res.stderr)
        assert isinstance(json.loads(res.stdout), dict)


def test_one_daemon_per_run_dir_and_clean_sigterm(kvd_factory):
    kvd = kvd_factory(gpu_blocks=8, dram_blocks=0, nvme_blocks=0)
    second = subprocess.run(KvdProcess(kvd.run_dir, max_groups=1, gpu_blocks=8).argv, capture_output=True,
                            text=True, timeout=60)
    assert second.returncode == 1 and "already running" in second.stderr
    with KvdClient(kvd.run_dir) as c:
        assert c.stats()  # the first one still serves
    assert kvd.stop() == 0
    assert not (kvd.run_dir / "kvd.sock").exists() and not (kvd.run_dir / "kvd.pid").exists()
    assert "kvd stopped" in kvd.log_tail()
