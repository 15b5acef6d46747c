"""One serving configuration as real processes: an optional kvd plus a specd, started fresh and stopped.

The configurations compared by ``bench serve`` differ only in the KV cache behind the same engine:

| name          | kvd policy   | tiers                 | what it stands for                         |
|---------------|--------------|-----------------------|--------------------------------------------|
| `standard`    | none         | specd's private pool  | no cache reuse at all                      |
| `standard-aa` | none         | specd's private pool  | a second `standard`: the A/A noise floor of a comparison |
| `prefix-lru`  | `lru`        | GPU                   | vLLM's prefix cache                        |
| `lru-offload` | `lru-offload`| GPU + DRAM            | LMCache's default CPU offload              |
| `ours`        | `reuse`      | GPU + DRAM + NVMe     | reuse-aware eviction over every tier       |
| `ours-dram`   | `reuse`      | GPU + DRAM            | `ours` without NVMe: the NVMe tier's effect |
| `ours-shortest`| `reuse`     | GPU + DRAM + NVMe     | `ours` with shortest prefills first: that order's effect |
| `ours-warm`   | `reuse`      | GPU + DRAM + NVMe     | `ours` reading requests during long forwards and warming their prefixes in kvd |

Every configuration gets the same GPU capacity (``gpu_blocks``: kvd's per-group GPU pool, or specd's
private pool for ``standard``), so a difference comes from what is kept, not from more room. The extra
tiers are sized by ``dram_blocks`` and ``nvme_blocks``.

Fresh processes per measurement are the simple way to keep a cache warmed by an earlier cell from
serving the same sessions and inflating the next cell's hit rate. They cost a start per cell (on the
GPU ~15-20 s: GGUF dequantization, CUDA-graph capture), so ``StackPool`` keeps one running stack per
configuration instead and ``Stack.reset`` returns it to a fresh process's cache state before each cell
(see there for what it resets and the one thing it cannot). Run directories are short temp paths (ipc:// socket
paths are limited to ~107 bytes); the daemons' logs are copied to ``log_dir`` on stop so a GPU run
brings them back with its results. A stack that uses kvd must show ``kvd_connected`` in specd's stats
before it counts as ready: specd falls back to its private pool when kvd is unreachable, and a
comparison against that fallback would be a silent lie.
"""
from __future__ import annotations

import os
import random
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Iterable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from bench.kvd_process import KvdProcess, config_flags
from client.kvd_client import KvdClient
from client.specd_client import SpecdClient, SpecdError

REPO = Path(__file__).resolve().parents[1]
WARMUP_PROMPT = "Once upon a time"  # shorter than one KV block: it warms the engine without seeding the cache
ENGINE_RESERVE_BLOCKS = 8            # specd's BlockManager keeps this many free blocks leased ahead of need
SWEEP_TOKEN_IDS = range(3, 259)      # byte-level ids every vocabulary here has (stories260K: 512, Qwen: 151,936)
MAX_SWEEPS = 4
IDLE_RELEASE_WAIT_S = 1.0   # how long a reset waits for specd's idle release (its server polls every 20 ms)


class StackError(RuntimeError):
    """A daemon did not start, exited, or came up in the wrong mode; the message holds its log tail."""


@dataclass(frozen=True)
class Tiering:
    """What kvd runs for one configuration; ``policy`` None means no kvd at all."""

    policy: str | None
    dram: bool = False
    nvme: bool = False
    specd_args: tuple[str, ...] = ()     # engine flags of this configuration alone (an ablation's switch)


CONFIGS: dict[str, Tiering] = {
    "standard": Tiering(None),
    "standard-aa": Tiering(None),        # the same stack again: how far two identical stacks differ in one run
    "prefix-lru": Tiering("lru"),
    "lru-offload": Tiering("lru-offload", dram=True),
    "ours": Tiering("reuse", dram=True, nvme=True),
    "ours-dram": Tiering("reuse", dram=True),
    "ours-shortest": Tiering("reuse", dram=True, nvme=True, specd_args=("--prefill-order=shortest",)),
    "ours-warm": Tiering("reuse", dram=True, nvme=True, specd_args=("--read-in-forward",)),
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
    half_life_s: float | None = None     # kvd's temperature half-life; None: kvd's default (scale it with time)
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
            "nvme_blocks": opts.nvme_blocks if tiering.nvme else 0, "half_life_s": opts.half_life_s}


def specd_argv(opts: StackOptions, run_dir: Path, port: int, kvd_run_dir: Path | None,
               tiering: Tiering | None = None) -> list[str]:
    """specd's command line: the run's shared settings, its extra flags, then the configuration's own."""
    fields: dict[str, Any] = {"model": opts.model, "device": opts.device, "run_dir": run_dir, "http_port": port,
                              "log_level": "warning", "max_model_len": opts.max_model_len,
                              "max_num_seqs": opts.max_num_seqs, "block_size": opts.block_size,
                              "kvd_run_dir": kvd_run_dir, "num_local_blocks": opts.gpu_blocks}
    own = tiering.specd_args if tiering is not None else ()
    return [sys.executable, "-m", "specd", *config_flags(**fields), *opts.specd_args, *own]


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
            self._start_specd(kvd_dir, tiering)
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

    def _start_specd(self, kvd_dir: Path | None, tiering: Tiering) -> None:
        self.run_dir.mkdir(parents=True)
        env = {**os.environ, "PYTHONPATH": f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}",
               "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1"), "PYTHONUNBUFFERED": "1"}
        with open(self.root / "specd.log", "wb") as log:
            self.specd = subprocess.Popen(specd_argv(self.opts, self.run_dir, self.port, kvd_dir, tiering),
                                          cwd=REPO,
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

    def kvd_stats(self) -> dict[str, Any]:
        """kvd's own stats (core counters plus ``server``: time per verb), over the admin socket."""
        if self.kvd is None:
            raise StackError(f"{self.name}: no kvd in this configuration")
        with KvdClient(self.kvd.run_dir, admin=True, timeout_s=10.0) as admin:
            return admin.stats()

    def stats_sources(self) -> dict[str, Any]:
        """Name -> fetch of every daemon's stats in this stack (bench/cell_stats.py snapshots them)."""
        return {"specd": self.stats, **({"kvd": self.kvd_stats} if self.kvd is not None else {})}

    def warm_up(self, timeout_s: float = 300.0) -> None:
        """One short request, so the first measured request does not pay for lazy initialization."""
        with SpecdClient(self.run_dir, timeout_s=timeout_s) as client:
            client.generate(WARMUP_PROMPT, max_tokens=2, temperature=0.0)

    def reset(self, timeout_s: float = 300.0) -> dict[str, int]:
        """Put a running stack back in a fresh process's cache state: kvd holds no published block.

        kvd's flush drops every *unleased* block. What can still hold published blocks is specd's
        block reserve: free blocks leased ahead of need in one write lease, which stays open (with every
        block committed through it) until all its blocks are used or given back. specd gives its reserve
        back once its server has been idle for a poll (20 ms; ``SpecEngine.release_idle``), not the instant
        its last request finishes (session 10: in a closed loop every admission step after a batch emptied
        allocated blocking again). So the reset sends two "sweep" requests, with prompts no workload
        shares (they no longer use up the reserve: a blocking refill restores it to its floor of up to 64
        blocks), then flushes all tiers until nothing published is left, for up to ``IDLE_RELEASE_WAIT_S``
        (the idle release), and sweeps again if something is.

        Not reset, because specd has no verb for it: the engine's learned think times per session class
        (specd/engine/hints.py ``ReturnTimeModel``; the bench gives every cell its own session ids, so
        the per-session part starts fresh). A cell thus starts with the class medians of the cells
        before it instead of the 30 s default. It changes the ``reuse`` policy's protection time of a
        class's first turns only, and no other configuration.
        """
        if self.kvd is None:
            return {"sweeps": 0, "flushed": 0}
        sweeps = flushed = 0
        with SpecdClient(self.run_dir, timeout_s=timeout_s) as specd, \
                KvdClient(self.kvd.run_dir, admin=True, timeout_s=30.0) as admin:
            while True:
                for _ in range(2 if sweeps == 0 else 1):
                    specd.generate(self._sweep_prompt(sweeps), max_tokens=1, temperature=0.0)
                    sweeps += 1
                deadline = time.monotonic() + IDLE_RELEASE_WAIT_S
                while True:              # the engine gives its reserve back once idle for a server poll
                    flushed += int(admin.flush(None))
                    left = published_blocks(admin.stats())
                    if left == 0:
                        return {"sweeps": sweeps, "flushed": flushed}
                    if time.monotonic() >= deadline:
                        break
                    time.sleep(0.02)
                if sweeps >= MAX_SWEEPS:
                    raise StackError(f"{self.name}: {left} published blocks still leased after {sweeps} sweeps")

    def _sweep_prompt(self, n: int) -> list[int]:
        """Token ids filling the reserve exactly: ENGINE_RESERVE_BLOCKS full blocks plus one token."""
        bs = self.opts.block_size or DEFAULT_BLOCK_SIZE
        rng = random.Random(f"sweep:{self.root}:{time.monotonic_ns()}:{n}")
        return [rng.choice(SWEEP_TOKEN_IDS) for _ in range(ENGINE_RESERVE_BLOCKS * bs + 1)]

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


DEFAULT_BLOCK_SIZE = 16  # specd's EngineConfig.block_size default


def published_blocks(kvd_stats: dict[str, Any]) -> int:
    """Blocks kvd indexes (published, in any tier) over all cache groups."""
    return sum(int(g["blocks"]) for g in kvd_stats.get("groups", {}).values())


class StackPool:
    """One running stack per configuration, for a persistent run: started together (each has its own
    kvd and specd; they share the machine and the GPU, and only one is measured at a time), warmed once,
    and ``reset`` before each cell. Use as a context manager; ``log_dir`` gets one folder per config."""

    def __init__(self, names: Iterable[str], opts: StackOptions, log_dir: Path | None = None):
        self.opts = opts
        self.log_dir = log_dir
        self.stacks: dict[str, Stack] = {}
        self.names = list(dict.fromkeys(names))

    def start(self) -> "StackPool":
        def one(name: str) -> Stack:
            logs = self.log_dir / name if self.log_dir is not None else None
            stack = Stack(name, replace(self.opts, log_dir=logs))
            self.stacks[name] = stack
            stack.start()
            stack.warm_up()
            return stack

        try:
            with ThreadPoolExecutor(len(self.names)) as pool:
                list(pool.map(one, self.names))
        except BaseException:
            self.stop()
            raise
        return self

    def ready(self, name: str) -> Stack:
        """The stack of ``name``, reset to a cold cache for the next cell."""
        stack = self.stacks[name]
        stack.reset()
        return stack

    def stop(self) -> None:
        for stack in self.stacks.values():
            stack.stop()

    def __enter__(self) -> "StackPool":
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
