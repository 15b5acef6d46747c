"""One serving configuration as real processes: an optional kvd plus a specd, started fresh and stopped.

The configurations compared by ``bench serve`` differ only in the KV cache behind the same engine:

| name          | kvd policy   | tiers                 | what it stands for                         |
|---------------|--------------|-----------------------|--------------------------------------------|
| `standard`    | none         | specd's private pool  | no cache reuse at all                      |
| `prefix-lru`  | `lru`        | GPU                   | vLLM's prefix cache                        |
| `lru-offload` | `lru-offload`| GPU + DRAM            | LMCache's default CPU offload              |
| `ours`        | `reuse`      | GPU + DRAM + NVMe     | reuse-aware eviction over every tier       |

Every configuration gets the same GPU capacity (``gpu_blocks``: kvd's per-group GPU pool, or specd's
private pool for ``standard``), so a difference comes from what is kept, not from more room. The extra
tiers are sized by ``dram_blocks`` and ``nvme_blocks``.

Why fresh processes per measurement: a cache warmed by an earlier cell would serve the same sessions
from memory and inflate the next cell's hit rate. Run directories are short temp paths (ipc:// socket
paths are limited to ~107 bytes); the daemons' logs are copied to ``log_dir`` on stop so a GPU run
brings them back with its results. A stack that uses kvd must show ``kvd_connected`` in specd's stats
before it counts as ready: specd falls back to its private pool when kvd is unreachable, and a
comparison against that fallback would be a silent lie.
"""
from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from bench.kvd_process import KvdProcess, config_flags
from client.specd_client import SpecdClient, SpecdError

REPO = Path(__file__).resolve().parents[1]


class StackError(RuntimeError):
    """A daemon did not start, exited, or came up in the wrong mode; the message holds its log tail."""


@dataclass(frozen=True)
class Tiering:
    """What kvd runs for one configuration; ``policy`` None means no kvd at all."""

    policy: str | None
    dram: bool = False
    nvme: bool = False


CONFIGS: dict[str, Tiering] = {
    "standard": Tiering(None),
    "prefix-lru": Tiering("lru"),
    "lru-offload": Tiering("lru-offload", dram=True),
    "ours": Tiering("reuse", dram=True, nvme=True),
}


@dataclass(frozen=True)
class StackOptions:
    """Settings shared by every configuration of one run."""

    model: Path
    device: str = "auto"                 # passed to specd (and kvd: where the GPU pool lives)
    gpu_blocks: int = 256                # GPU KV blocks, equal for every configuration
    dram_blocks: int = 1024              # DRAM tier blocks (lru-offload, ours)
    nvme_blocks: int = 4096              # NVMe tier blocks (ours)
    max_model_len: int | None = None
    max_num_seqs: int | None = None
    block_size: int | None = None
    specd_args: tuple[str, ...] = ()     # extra specd flags, passed through as given
    ready_timeout_s: float = 600.0       # a large GGUF dequantizes on the CPU before serving
    log_dir: Path | None = None          # where the daemons' logs are kept on stop (specd.log, kvd.log)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def kvd_fields(tiering: Tiering, opts: StackOptions, run_dir: Path) -> dict[str, Any]:
    """KvdConfig fields of a configuration. One cache group (no drafter yet), so the per-group block
    counts are the whole tiers."""
    device = {"cuda": "cuda", "cpu": "cpu"}.get(opts.device.split(":")[0], "auto")
    return {"policy": tiering.policy, "device": device, "max_groups": 1, "gpu_blocks": opts.gpu_blocks,
            "dram_blocks": opts.dram_blocks if tiering.dram else 0,
            "nvme_dir": run_dir / "nvme" if tiering.nvme else None,
            "nvme_blocks": opts.nvme_blocks if tiering.nvme else 0}


def specd_argv(opts: StackOptions, run_dir: Path, port: int, kvd_run_dir: Path | None) -> list[str]:
    fields: dict[str, Any] = {"model": opts.model, "device": opts.device, "run_dir": run_dir, "http_port": port,
                              "log_level": "warning", "max_model_len": opts.max_model_len,
                              "max_num_seqs": opts.max_num_seqs, "block_size": opts.block_size,
                              "kvd_run_dir": kvd_run_dir, "num_local_blocks": opts.gpu_blocks}
    return [sys.executable, "-m", "specd", *config_flags(**fields), *opts.specd_args]


@dataclass
class Stack:
    """A running configuration. Use as a context manager; ``run_dir`` is specd's (for the IPC client)."""

    name: str
    opts: StackOptions
    root: Path = field(init=False)
    run_dir: Path = field(init=False)
    port: int = field(init=False)
    info: dict[str, Any] = field(init=False, default_factory=dict)
    kvd: KvdProcess | None = field(init=False, default=None)
    specd: subprocess.Popen | None = field(init=False, default=None)

    def __post_init__(self) -> None:
        if self.name not in CONFIGS:
            raise StackError(f"unknown configuration {self.name!r}; choose from {', '.join(CONFIGS)}")
        self.root = Path(tempfile.mkdtemp(prefix=f"st-{self.name[:6]}-", dir="/tmp"))
        self.run_dir = self.root / "specd"
        self.port = free_port()

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}/v1"

    def start(self) -> "Stack":
        tiering = CONFIGS[self.name]
        try:
            kvd_dir = self._start_kvd(tiering) if tiering.policy else None
            self._start_specd(kvd_dir)
        except BaseException:
            self.stop()
            raise
        return self

    def _start_kvd(self, tiering: Tiering) -> Path:
        self.kvd = KvdProcess(self.root / "kvd", **kvd_fields(tiering, self.opts, self.root))
        try:
            self.kvd.start(timeout_s=60.0)
        except (RuntimeError, TimeoutError) as exc:
            raise StackError(f"{self.name}: kvd did not start: {exc}") from None
        return self.kvd.run_dir

    def _start_specd(self, kvd_dir: Path | None) -> None:
        self.run_dir.mkdir(parents=True)
        env = {**os.environ, "PYTHONPATH": f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}",
               "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1"), "PYTHONUNBUFFERED": "1"}
        with open(self.root / "specd.log", "wb") as log:
            self.specd = subprocess.Popen(specd_argv(self.opts, self.run_dir, self.port, kvd_dir), cwd=REPO,
                                          env=env, stdout=log, stderr=subprocess.STDOUT)
        self._wait_specd(kvd_dir is not None)

    def _wait_specd(self, needs_kvd: bool) -> None:
        """Ready = IPC answers ``info``, the gateway answers /v1/models, and kvd is attached if asked."""
        deadline = time.monotonic() + self.opts.ready_timeout_s
        with SpecdClient(self.run_dir, timeout_s=1.0) as probe:
            while time.monotonic() < deadline:
                if self.specd.poll() is not None:
                    raise StackError(f"{self.name}: specd exited with {self.specd.returncode}:\n{self.log_tail()}")
                try:
                    self.info = probe.info()
                    stats = probe.stats()
                except SpecdError:
                    continue
                if needs_kvd and not stats.get("kvd_connected"):
                    raise StackError(f"{self.name}: specd serves without kvd (kvd_connected=0):\n{self.log_tail()}")
                if self._gateway_up():
                    return
                time.sleep(0.2)
        raise StackError(f"{self.name}: specd not ready in {self.opts.ready_timeout_s}s:\n{self.log_tail()}")

    def _gateway_up(self) -> bool:
        try:
            with urllib.request.urlopen(self.base_url + "/models", timeout=2.0) as resp:
                return resp.status == 200
        except OSError:
            return False

    def stats(self) -> dict[str, Any]:
        with SpecdClient(self.run_dir, timeout_s=10.0) as client:
            return client.stats()

    def log_tail(self, lines: int = 40) -> str:
        path = self.root / "specd.log"
        text = path.read_text(errors="replace") if path.exists() else "(no specd log)"
        kvd = f"\n--- kvd ---\n{self.kvd.log_tail(lines)}" if self.kvd else ""
        return "\n".join(text.splitlines()[-lines:]) + kvd

    def stop(self) -> None:
        """SIGTERM specd then kvd (SIGKILL if they hang), keep the logs, remove the run directories."""
        if self.specd is not None and self.specd.poll() is None:
            self.specd.terminate()
            try:
                self.specd.wait(20)
            except subprocess.TimeoutExpired:
                self.specd.kill()
                self.specd.wait()
        if self.kvd is not None:
            try:
                self.kvd.stop()
            except subprocess.TimeoutExpired:
                pass
        self._keep_logs()
        shutil.rmtree(self.root, ignore_errors=True)

    def _keep_logs(self) -> None:
        if self.opts.log_dir is None:
            return
        self.opts.log_dir.mkdir(parents=True, exist_ok=True)
        for src in (self.root / "specd.log", self.root / "kvd" / "kvd.log"):
            if src.exists():
                shutil.copyfile(src, self.opts.log_dir / src.name)

    def __enter__(self) -> "Stack":
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
