"""Shared fixture for the kvd I/O tests: real kvd processes in temp dirs, stopped at teardown."""
from __future__ import annotations

from pathlib import Path

import pytest

from bench.kvd_process import KvdProcess


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
