"""Shared fixtures for the kvd I/O tests: real kvd processes in temp dirs, stopped at teardown, and an
in-process kvd server on a thread with a client attached to group "full" (``kvd``)."""
from __future__ import annotations

import threading
from pathlib import Path

import pytest

from bench.kvd_process import KvdProcess
from client.kvd_client import KvdClient
from kvd.config import KvdConfig
from kvd.core import KvdCore
from kvd.server import KvdServer


@pytest.fixture
def kvd_factory(tmp_path):
    """Start kvd processes with KvdConfig fields; every one is stopped (or killed) at teardown."""
    procs: list[KvdProcess] = []

    def start(run_dir=None, wrapper=(), **fields) -> KvdProcess:
        fields.setdefault("max_groups", 1)
        proc = KvdProcess(run_dir or tmp_path / f"run{len(procs)}", wrapper=wrapper, **fields)
        procs.append(proc)
        return proc.start()

    yield start
    for proc in procs:
        try:
            proc.stop(10)
        except Exception:
            proc.kill()
        if proc.proc is not None:  # pools a SIGKILLed kvd could not unlink
            for leftover in Path("/dev/shm").glob(f"kvd-{proc.pid}-*"):
                leftover.unlink(missing_ok=True)


@pytest.fixture
def kvd(tmp_path):
    """A KvdCore (4 GPU blocks, CPU) behind a KvdServer on a thread; a client attached to group "full"."""
    core = KvdCore(KvdConfig(run_dir=tmp_path / "run", device="cpu", gpu_blocks=4, dram_blocks=0, max_groups=1))
    server = KvdServer(core, tmp_path / "run")
    server.bind()
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    client = KvdClient(tmp_path / "run", timeout_s=5.0)
    client.attach("full", 64)
    yield client
    client.close()
    server.request_stop()
    thread.join(5)
    server.close()
