"""Faults against a real kvd: kill -9 in the middle of commits, a client that dies holding leases,
and a disk that fills up. In every case nothing wrong is ever served and the daemon keeps serving."""
from __future__ import annotations

import os
import random
import shutil
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest

from client.kvd_client import KvdClient, KvdClientError, map_pool
from kvd_blocks import BLOCK_BYTES, chain_of, commit_chain, served_bytes_match

pytestmark = pytest.mark.slow
TIERED = dict(policy="reuse", admission="none", gpu_blocks=8, dram_blocks=8, nvme_blocks=512)


def commit_until_stopped(run_dir: Path, seed: int, done: list[list[bytes]], stop: threading.Event) -> None:
    """Commit 2-block chains with known bytes until told to stop or kvd dies under us."""
    try:
        with KvdClient(run_dir, timeout_s=2) as c:
            pool = map_pool(c.attach("full", BLOCK_BYTES))
            for i in range(10_000):
                if stop.is_set():
                    return
                chain = chain_of(seed * 100_000 + i, 2)
                commit_chain(c, pool, chain)
                done.append(chain)
    except KvdClientError:
        return  # kvd was killed mid-commit: expected


def corrupt_one_slab_byte(nvme_dir: Path, rng: random.Random) -> None:
    files = [p for p in nvme_dir.rglob("*") if p.is_file() and p.stat().st_size > 0]
    if files:
        victim = max(files, key=lambda p: p.stat().st_size)  # the slab, not the index
        with open(victim, "r+b") as f:
            f.seek(rng.randrange(victim.stat().st_size))
            byte = f.read(1)
            f.seek(-1, os.SEEK_CUR)
            f.write(bytes([byte[0] ^ 0xFF]))


def test_kill9_mid_commit_never_serves_wrong_bytes(kvd_factory, tmp_path):
    nvme, run = tmp_path / "nvme", tmp_path / "run"
    rng = random.Random(0)
    committed: list[list[bytes]] = []
    served = 0
    for round_ in range(3):
        kvd = kvd_factory(run_dir=run, nvme_dir=nvme, **TIERED)
        stop = threading.Event()
        writer = threading.Thread(target=commit_until_stopped, args=(run, round_, committed, stop))
        writer.start()
        deadline = time.monotonic() + 10
        while len(committed) < 40 * (round_ + 1) and time.monotonic() < deadline:
            time.sleep(0.01)
        kvd.kill()  # SIGKILL while the writer is still committing
        stop.set()
        writer.join(10)
        if round_ == 1:
            corrupt_one_slab_byte(nvme, rng)
        kvd = kvd_factory(run_dir=run, nvme_dir=nvme, **TIERED)
        with KvdClient(run) as c:
            assert c.leases() in ([], {}), "leases of the killed daemon survived"
            pool = map_pool(c.attach("full", BLOCK_BYTES))
            served += sum(served_bytes_match(c, pool, chain) for chain in committed)
        kvd.stop()
    assert served > 0, "nothing survived the restarts: the NVMe tier was not exercised"


DYING_CLIENT = textwrap.dedent("""
    import os, sys, time
    from client.kvd_client import KvdClient
    c = KvdClient(sys.argv[1], identity=b"doomed-client")
    c.attach("full", 64)
    lease, blocks = c.allocate("full", 3)
    print(lease, flush=True)
    time.sleep(60)
""")


def test_dead_client_leases_are_reclaimed_after_ttl(kvd_factory, tmp_path):
    kvd = kvd_factory(gpu_blocks=4, dram_blocks=0, nvme_blocks=0, lease_ttl_s=1.0, heartbeat_s=0.5)
    child = subprocess.Popen([sys.executable, "-c", DYING_CLIENT, str(kvd.run_dir)], stdout=subprocess.PIPE,
                             text=True, cwd=Path(__file__).resolve().parents[2])
    try:
        assert int(child.stdout.readline()) > 0
        with KvdClient(kvd.run_dir) as c:
            assert "doomed-client" in repr(c.leases())
            child.kill()
            child.wait()
            c.start_heartbeat(0.3)  # our own lease must survive while theirs expires
            deadline = time.monotonic() + 10
            while "doomed-client" in repr(c.leases()) and time.monotonic() < deadline:
                time.sleep(0.1)
            assert "doomed-client" not in repr(c.leases())
            c.attach("full", 64)
            lease, blocks = c.allocate("full", 4)  # all 4 blocks are free again
            assert len(blocks) == 4
            time.sleep(1.5)  # > TTL: heartbeats keep it
            c.release(lease)
    finally:
        child.kill()


def _tiny_fs_wrapper(mount_point: Path, size: str) -> list[str]:
    """Run kvd in a private mount namespace with a tiny tmpfs at mount_point: a real ENOSPC without
    root on the host (user namespaces) and nothing left mounted afterwards."""
    script = 'mount -t tmpfs -o size="$1" tmpfs "$2" && shift 2 && exec "$@"'
    return ["unshare", "-Urm", "sh", "-c", script, "sh", size, str(mount_point)]


def _can_make_tiny_fs(tmp_path: Path) -> bool:
    if shutil.which("unshare") is None:
        return False
    probe = tmp_path / "probe"
    probe.mkdir()
    res = subprocess.run([*_tiny_fs_wrapper(probe, "16k"), "true"], capture_output=True, timeout=30)
    return res.returncode == 0


def test_disk_full_degrades_with_warning(kvd_factory, tmp_path):
    if not _can_make_tiny_fs(tmp_path):
        pytest.skip("cannot mount a private tmpfs (no user namespaces here)")
    nvme = tmp_path / "nvme"
    nvme.mkdir()
    kvd = kvd_factory(wrapper=_tiny_fs_wrapper(nvme, "32k"), nvme_dir=nvme, nvme_bytes=1 << 24,
                      **{**TIERED, "nvme_blocks": None})
    with KvdClient(kvd.run_dir) as c:
        pool = map_pool(c.attach("full", BLOCK_BYTES))
        chains = [chain_of(7_000 + i, 2) for i in range(200)]  # 400 blocks x 256 B > 32 KiB
        for chain in chains:
            commit_chain(c, pool, chain)
        deadline = time.monotonic() + 10
        while "No space" not in kvd.log_tail(200) and "ENOSPC" not in kvd.log_tail(200) \
                and time.monotonic() < deadline:
            time.sleep(0.1)
        log = kvd.log_tail(200)
        assert "WARNING" in log and ("No space" in log or "ENOSPC" in log or "disk full" in log.lower()), log
        for chain in chains:
            served_bytes_match(c, pool, chain)  # whatever is still served is right
        assert c.stats()  # still serving
