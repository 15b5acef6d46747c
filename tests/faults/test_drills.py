"""Fault drills through the whole stack (DESIGN.md §9), in a loop: kill -9 kvd or specd under load,
disk full under specd, and a DRAM tier larger than memory. Every completed output must equal the
greedy output of an uncached reference engine; what fails must fail loudly, never wrong."""
from __future__ import annotations

import hashlib
import random
import sys
import threading
import time
from collections import Counter
from pathlib import Path

import pytest

from bench.kvd_process import KvdProcess
from client.kvd_client import KvdClient
from client.specd_client import SpecdClient, SpecdError
from tests.serving import specd_process

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "kvd_io"))
from test_faults import _can_make_tiny_fs, _tiny_fs_wrapper  # noqa: E402  (the kvd_io helpers, reused)

pytestmark = pytest.mark.slow

STORY = "Once upon a time, there was a little girl named Lily. She loved to play outside in the park. "
PROMPTS = [STORY + end for end in ("One day, she saw a big red ball.", "Her dog Max ran to the tree.",
                                   "Tom came to play with them.", "The sun was hot and bright.")]
MAX_TOKENS = 24


@pytest.fixture(scope="module")
def reference() -> dict[str, list[int]]:
    """Greedy outputs of an in-process engine with no cache at all."""
    from specd.engine.config import EngineConfig
    from specd.engine.engine import SpecEngine
    from specd.engine.request import Request
    from specd.sampling_params import SamplingParams

    engine = SpecEngine.from_config(EngineConfig())
    out: dict[str, list[int]] = {}
    for k, p in enumerate(PROMPTS):
        engine.add_request(Request(str(k), engine.tokenizer.encode(p),
                                   SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS)))
        ids: list[int] = []
        while engine.has_work():
            for o in engine.step():
                ids += o.token_ids
        out[p] = ids
    return out


def load(run_dir: str, reference: dict, results: list, stop: threading.Event, seed: int, phase: list) -> None:
    """Stream requests until told to stop; record (status, right, phase) per request."""
    rng = random.Random(seed)
    while not stop.is_set():
        p = rng.choice(PROMPTS)
        try:
            with SpecdClient(run_dir, timeout_s=5) as c:
                ids = [t for d in c.stream(p, temperature=0.0, max_tokens=MAX_TOKENS) for t in d.token_ids]
            results.append(("ok", ids == reference[p], phase[0]))
        except SpecdError:
            results.append(("failed", False, phase[0]))   # the daemon died under it: an error, not a wrong answer
            time.sleep(0.2)


def right(run_dir: str, reference: dict) -> bool:
    with SpecdClient(run_dir, timeout_s=5) as c:
        assert c.generate(PROMPTS[0], temperature=0.0, max_tokens=MAX_TOKENS).token_ids == reference[PROMPTS[0]]
    return True


def stats(run_dir: str) -> dict:
    with SpecdClient(run_dir, timeout_s=5) as c:
        return c.stats()


def wait_for(pred, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            if pred():
                return
        except SpecdError:
            pass
        time.sleep(0.2)
    raise AssertionError(f"timed out waiting for {what}")


def test_kill9_loop_never_serves_wrong_output(tmp_path, reference):
    kvd_dir = tmp_path / "kvd"
    kvd_args = dict(gpu_bytes=8 << 20, dram_bytes=8 << 20, max_groups=1, lease_ttl_s=4.0, heartbeat_s=1.0)
    kvd = KvdProcess(kvd_dir, **kvd_args).start()
    specd = specd_process.start(["-m", "specd", "--kvd-run-dir", str(kvd_dir)])
    rng = random.Random(7)
    results: list = []
    phase = ["start"]
    try:
        for it, victim in enumerate(("kvd", "specd", "kvd")):
            stop = threading.Event()
            phase[0] = f"{it}: before kill -9 {victim}"
            threads = [threading.Thread(target=load, args=(specd.run_dir, reference, results, stop, 10 * it + j,
                                                           phase)) for j in range(3)]
            for t in threads:
                t.start()
            time.sleep(rng.uniform(0.5, 2.0))                      # a random moment under load
            phase[0] = f"{it}: after kill -9 {victim}"
            if victim == "kvd":
                kvd.kill()
                wait_for(lambda: stats(specd.run_dir)["kvd_connected"] == 0, 15, "specd to notice kvd is gone")
                time.sleep(0.5)                                    # keep serving on recompute for a while
                stop.set()
                for t in threads:
                    t.join(30)
                kvd = KvdProcess(kvd_dir, **kvd_args).start()
                # specd re-attaches at its next step that finds no running sequence: traffic wakes it
                wait_for(lambda: right(specd.run_dir, reference) and stats(specd.run_dir)["kvd_connected"] == 1,
                         20, "specd to re-attach to kvd")
            else:
                dead = specd.proc.pid
                specd.proc.kill()
                specd.proc.wait()
                stop.set()
                for t in threads:
                    t.join(30)
                with KvdClient(kvd_dir) as c:                      # the dead worker's leases are reclaimed
                    wait_for(lambda: str(dead) not in repr(c.leases()) and not c.leases(), 15, "lease reclaim")
                specd = specd_process.start(["-m", "specd", "--kvd-run-dir", str(kvd_dir)])
        with SpecdClient(specd.run_dir, timeout_s=10) as c:       # after it all: cached and still right
            for p in PROMPTS[:2]:
                r = c.generate(p, temperature=0.0, max_tokens=MAX_TOKENS)
                assert r.token_ids == reference[p]
            assert r.usage.cached_tokens > 0
    finally:
        specd_process.stop(specd)
        kvd.kill()
    done = [(right, ph) for status, right, ph in results if status == "ok"]
    wrong = Counter(ph for right, ph in done if not right)
    assert done and not wrong, f"{sum(wrong.values())} of {len(done)} completed outputs differ: {dict(wrong)}"


def test_disk_full_under_specd_degrades_and_stays_right(tmp_path, reference):
    if not _can_make_tiny_fs(tmp_path):
        pytest.skip("cannot mount a private tmpfs (no user namespaces here)")
    nvme = tmp_path / "nvme"
    nvme.mkdir()
    kvd = KvdProcess(tmp_path / "kvd", wrapper=_tiny_fs_wrapper(nvme, "64k"), policy="reuse", admission="none",
                     gpu_blocks=24, dram_blocks=8, nvme_dir=nvme, nvme_bytes=1 << 26, max_groups=1).start()
    specd = specd_process.start(["-m", "specd", "--kvd-run-dir", str(kvd.run_dir)])
    try:
        with SpecdClient(specd.run_dir, timeout_s=20) as c:
            for k in range(12):
                for p in PROMPTS:
                    prompt = f"{k} {p}"          # new prefixes push older blocks down to NVMe
                    c.generate(prompt, temperature=0.0, max_tokens=4)
            for p in PROMPTS:
                assert c.generate(p, temperature=0.0, max_tokens=MAX_TOKENS).token_ids == reference[p]
            assert c.stats()["kvd_connected"] == 1
        log = kvd.log_tail(400)
        assert "WARNING" in log and ("No space" in log or "ENOSPC" in log), log
    finally:
        specd_process.stop(specd)
        kvd.stop()


def test_dram_tier_larger_than_memory_degrades_to_fewer_tiers(tmp_path):
    if not _can_make_tiny_fs(tmp_path):
        pytest.skip("cannot mount a private tmpfs (no user namespaces here)")
    # /dev/shm of 1 MiB in kvd's own mount namespace; a 100 MB DRAM tier cannot be had
    kvd = KvdProcess(tmp_path / "kvd", wrapper=_tiny_fs_wrapper(Path("/dev/shm"), "1m"), policy="lru-offload",
                     gpu_blocks=4, dram_blocks=100_000, max_groups=1).start()
    try:
        with KvdClient(kvd.run_dir, timeout_s=5) as c:
            c.attach("full", 1024)
            parent = None
            for i in range(1500):           # 1.5 MB of blocks: past /dev/shm, SIGBUS before the fix
                lease, ids = c.allocate("full", 1)
                h = hashlib.blake2b(str(i).encode(), digest_size=16).digest()
                c.commit(lease, [(ids[0], h, parent)])
                c.release(lease)
                parent = h
            group = c.stats()["groups"]["full"]
        assert kvd.proc.poll() is None
        assert "dram" not in group["tiers"] and group["dram_unavailable"] == 1
        assert "WARNING" in kvd.log_tail(50) and "DRAM tier" in kvd.log_tail(50)
    finally:
        kvd.stop()
