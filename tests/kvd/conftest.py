"""Shared fixtures: a KvdCore on a fake clock, with pools under tmp_path and no worker threads."""
from __future__ import annotations

import hashlib
import time

import pytest
import torch

from kvd.config import KvdConfig
from kvd.core import KvdCore

torch.set_num_threads(1)
BB = 64  # block_bytes: tiny blocks keep the tests fast


class Clock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


def h(i: int) -> bytes:
    """A deterministic 16-byte test hash."""
    return hashlib.blake2b(b"t%d" % i, digest_size=16).digest()


@pytest.fixture
def clock() -> Clock:
    return Clock()


@pytest.fixture
def make_core(tmp_path, clock):
    cores: list[KvdCore] = []

    def make(**kw) -> KvdCore:
        kw.setdefault("gpu_blocks", 4)
        kw.setdefault("dram_blocks", 0)
        kw.setdefault("move_workers", 0)
        kw.setdefault("lease_ttl_s", 10.0)
        kw.setdefault("heartbeat_s", 1.0)
        cfg = KvdConfig(run_dir=tmp_path / "run", **kw)
        core = KvdCore(cfg, clock=clock)
        core.attach("c", "full", BB)
        cores.append(core)
        return core

    yield make
    for c in cores:
        c.close()


def put_chain(core: KvdCore, ids: list[int], client: str = "c", parent: bytes | None = None, fill=None, data=None):
    """Allocate, write (optionally: ``fill(i)`` a byte value, ``data(i)`` a [BB] tensor), commit and release a
    chain of test hashes; returns block ids. Bytes go in before the commit: once published and released, a
    cleaner thread may copy the block down at any time."""
    lease, blocks = core.allocate(client, "full", len(ids))
    pool = core.groups["full"].gpu.tensor
    items = []
    for b, i in zip(blocks, ids):
        if fill is not None:
            pool[b].fill_(fill(i))
        if data is not None:
            pool[b].copy_(data(i))
        items.append((b, h(i), parent))
        parent = h(i)
    out = core.commit(client, lease, items)
    core.release(client, lease)
    return out


def settle(core: KvdCore) -> None:
    """Let the background cleaner reach its watermarks: inline (move_workers=0) through tick(); with a
    cleaner thread, passes from this thread are safe too (in-flight demotions count toward the reserve),
    and we also wait for the thread's batches to land."""
    core.tick()
    while core.clean() or any(sum(g.inflight.values()) for g in core.groups.values()):
        time.sleep(0.001)
