"""A real kvd daemon in a subprocess, for benchmarks and fault tests.

Why a subprocess and not a thread: the benchmark must measure the real IPC path, and the fault tests
must be able to ``kill -9`` the daemon. It runs ``sys.executable -m kvd`` so PATH does not matter,
logs to ``<run_dir>/kvd.log``, and counts as started once ``stats`` answers over the socket.
"""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Optional, Sequence

from client.kvd_client import KvdClient, KvdClientError


def config_flags(**fields: Any) -> list[str]:
    """KvdConfig fields as kvd flags; None means 'not given'."""
    out: list[str] = []
    for name, value in fields.items():
        if value is not None:
            out += [f"--{name.replace('_', '-')}", str(value)]
    return out


class KvdProcess:
    """Start, wait for, signal and reap one kvd. Use as a context manager (SIGTERM on exit)."""

    def __init__(self, run_dir: str | os.PathLike[str], *, wrapper: Sequence[str] = (), **fields: Any):
        self.run_dir = Path(run_dir)
        self.log_path = self.run_dir / "kvd.log"
        self.argv = [*wrapper, sys.executable, "-m", "kvd", *config_flags(run_dir=self.run_dir, **fields)]
        self.proc: Optional[subprocess.Popen] = None

    def start(self, timeout_s: float = 60.0) -> "KvdProcess":
        self.run_dir.mkdir(parents=True, exist_ok=True)
        env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(self.argv, stdout=log, stderr=subprocess.STDOUT, env=env)
        self._wait_ready(timeout_s)
        return self

    def _wait_ready(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        with KvdClient(self.run_dir, timeout_s=0.5) as probe:
            while time.monotonic() < deadline:
                if self.proc.poll() is not None:
                    raise RuntimeError(f"kvd exited with {self.proc.returncode}:\n{self.log_tail()}")
                try:
                    probe.stats()
                    return
                except KvdClientError:
                    time.sleep(0.05)
        self.kill()
        raise TimeoutError(f"kvd not ready in {timeout_s}s:\n{self.log_tail()}")

    def log_tail(self, lines: int = 30) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except FileNotFoundError:
            return "(no log)"

    @property
    def pid(self) -> int:
        return self.proc.pid

    def stop(self, timeout_s: float = 20.0) -> int:
        """SIGTERM (clean shutdown: NVMe index flushed) and wait; SIGKILL if it hangs."""
        if self.proc is None or self.proc.poll() is not None:
            return self.proc.returncode if self.proc else 0
        self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            self.kill()
            raise

    def kill(self) -> None:
        """SIGKILL, as a crash: nothing is flushed."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()

    def __enter__(self) -> "KvdProcess":
        return self.start()

    def __exit__(self, *exc: Any) -> None:
        self.stop()
