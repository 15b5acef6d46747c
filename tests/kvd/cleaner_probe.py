"""Request-path latency of KvdCore with a full, tiered GPU tier: the before/after probe of background
cleaning (docs/design/kvd.md, "Background cleaning").

An in-process KvdCore with its real mover and cleaner threads, Qwen-0.5B-sized blocks (192 KiB), a small
GPU tier and DRAM + NVMe behind it. Each request is one session turn: look up the session's chain so far
(its earlier turns may have been demoted; promotions are waited for), then allocate and commit the
turn's new blocks, then release. Sessions are picked at random, so the GPU tier keeps overflowing. It
times each request-path call (lookup + wait_ready, allocate, commit) on the calling thread and reports
percentiles, the token hit rate and the drops. Runs against any revision of kvd (it uses only the
public KvdCore API), so the same command measures the code before the change.

    python -m tests.kvd.cleaner_probe --requests 600 --repeats 3 [--set pressure_wait_ms=0]
"""
from __future__ import annotations

import argparse
import json
import random
import statistics
import tempfile
import time
from pathlib import Path

import torch

from kvd.config import KvdConfig
from kvd.core import KvdCore
from tests.kvd.conftest import h

BLOCK_BYTES = 196_608   # Qwen2.5-0.5B, bf16, 16-token blocks


def count_copies() -> dict[str, int]:
    """Count the copies memory-to-memory tier moves issue (runs of adjacent slots) and the blocks they carry,
    by wrapping ``kvd.tiers.base.slot_runs`` (every run-wise copy goes through it): copies per block is 1
    when nothing coalesces and falls as chains land adjacent."""
    import kvd.tiers.base as base

    seen = {"copies": 0, "blocks": 0}
    real = getattr(base.slot_runs, "__wrapped__", base.slot_runs)

    def counted(a, b):
        runs = real(a, b)
        seen["copies"] += len(runs)
        seen["blocks"] += len(a)
        return runs

    counted.__wrapped__ = real
    base.slot_runs = counted
    return seen


def run_once(args: argparse.Namespace, seed: int, overrides: dict) -> dict:
    rng = random.Random(seed)
    copies = count_copies()
    with tempfile.TemporaryDirectory(dir="/tmp") as tmp:
        cfg = KvdConfig(run_dir=Path(tmp) / "run", policy=args.policy, admission="none", max_groups=1,
                        gpu_blocks=args.gpu_blocks, dram_blocks=args.dram_blocks, nvme_blocks=args.nvme_blocks,
                        nvme_dir=Path(tmp) / "nvme", device="cpu", move_workers=1, **overrides)
        core = KvdCore(cfg)
        core.attach("p", "full", BLOCK_BYTES)
        pool = core.groups["full"].gpu.tensor
        chains: dict[int, list[int]] = {}
        gen: dict[int, int] = {}
        lat: dict[str, list[float]] = {"lookup": [], "allocate": [], "commit": [], "request": []}
        asked = hit = 0
        for r in range(args.requests):
            s = rng.randrange(args.sessions)
            chain = chains.setdefault(s, [])
            if len(chain) >= args.max_blocks:          # the session ends; a new one takes its place
                chain = chains[s] = []
                gen[s] = gen.get(s, 0) + 1
            base = (s * 1000 + gen.get(s, 0)) * 1000
            new = [base + len(chain) + k for k in range(args.turn_blocks)]
            t0 = time.perf_counter()
            res = core.lookup("p", "full", [h(i) for i in chain])
            core.wait_ready(res.lease, timeout=10)
            t1 = time.perf_counter()
            asked += len(chain)
            hit += len(res.hits)
            lease, blocks = core.allocate("p", "full", len(chain) - len(res.hits) + len(new))
            t2 = time.perf_counter()
            pool[blocks[0]].fill_(r % 251)            # the engine writes its KV here (one touch suffices)
            ids = chain[len(res.hits):] + new
            parent = h(chain[len(res.hits) - 1]) if res.hits else None
            items = []
            for b, i in zip(blocks, ids):
                items.append((b, h(i), parent))
                parent = h(i)
            t3 = time.perf_counter()
            core.commit("p", lease, items)
            t4 = time.perf_counter()
            core.release("p", lease)
            core.release("p", res.lease)
            chain += new
            lat["lookup"].append(t1 - t0)
            lat["allocate"].append(t2 - t1)
            lat["commit"].append(t4 - t3)
            lat["request"].append((t1 - t0) + (t2 - t1) + (t4 - t3))
            time.sleep(args.think_s)                  # the engine's forward: the cleaner's window
        stats = core.stats()
        core.close()
    out = {k: {"p50_ms": 1e3 * statistics.median(v), "p99_ms": 1e3 * sorted(v)[int(0.99 * (len(v) - 1))],
               "mean_ms": 1e3 * statistics.fmean(v)} for k, v in lat.items()}
    out["hit_rate"] = hit / asked if asked else 0.0
    out["pressure_drops"] = stats.get("pressure_drops", 0)
    out["demotions"] = stats["demotions"]
    out["evictions"] = stats["evictions"]
    out["copies_per_block"] = copies["copies"] / copies["blocks"] if copies["blocks"] else None
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--requests", type=int, default=600)
    p.add_argument("--sessions", type=int, default=24)
    p.add_argument("--turn-blocks", type=int, default=8)
    p.add_argument("--max-blocks", type=int, default=64, help="a session's chain length before it restarts")
    p.add_argument("--gpu-blocks", type=int, default=256)
    p.add_argument("--dram-blocks", type=int, default=256)
    p.add_argument("--nvme-blocks", type=int, default=2048)
    p.add_argument("--think-s", type=float, default=0.002)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--policy", default="reuse", help="kvd eviction policy (reuse, lru-offload, ...)")
    p.add_argument("--set", action="append", default=[], metavar="FIELD=VALUE", help="KvdConfig override")
    args = p.parse_args()
    torch.set_num_threads(1)
    overrides = dict(kv.split("=", 1) for kv in args.set)
    runs = [run_once(args, seed, overrides) for seed in range(args.repeats)]
    print(json.dumps(runs, indent=1))


if __name__ == "__main__":
    main()
