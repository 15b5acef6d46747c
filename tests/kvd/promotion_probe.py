"""Promotion latency of one lease: N blocks of 192 KiB in DRAM promoted back to the GPU tier, timed from the
lookup to wait_ready answering (docs/design/kvd.md, "Batched promotions"). On this CPU machine the "GPU"
tier is a CPU tensor, so the time is mostly the memory copy; the jobs and lock trips at finish are the
part that carries over to a GPU.

    python -m tests.kvd.promotion_probe --blocks 512 --workers 1 --repeats 7
"""
from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import torch

from kvd.config import KvdConfig
from kvd.core import KvdCore
from kvd.demotion import Demotion
from kvd.types import Tier
from tests.kvd.conftest import h

BLOCK_BYTES = 196_608   # Qwen2.5-0.5B, bf16, 16-token blocks


def one(n: int, workers: int) -> tuple[float, dict[str, int]]:
    """One cold promotion of an n-block chain; returns (seconds, jobs submitted and finished)."""
    core = KvdCore(KvdConfig(run_dir=Path(tempfile.mkdtemp()) / "run", policy="lru-offload", admission="none",
                             gpu_blocks=n + 64, dram_blocks=n + 64, move_workers=workers, device="cpu",
                             clean_low=0.0, clean_high=0.0))
    core.attach("c", "full", BLOCK_BYTES)
    g = core.groups["full"]
    lease, blocks = core.allocate("c", "full", n)
    for k, b in enumerate(blocks):
        g.gpu.tensor[b].fill_(k % 251)
    core.commit("c", lease, [(b, h(k), h(k - 1) if k else None) for k, b in enumerate(blocks)])
    core.release("c", lease)
    with core._lock:                                  # every block down to DRAM, by the cleaner's own machinery
        jobs = g.plan_demotions(Tier.GPU, n)
    core._finish_batch(g, jobs, None, Demotion.run_batch(jobs))
    assert all(g.index.get(h(k)).tier is Tier.DRAM for k in range(n))
    ops = {"submits": 0, "finishes": 0}
    submit, done = core.mover.submit, core.mover._on_done

    def counted_submit(job):
        ops["submits"] += 1
        submit(job)

    def counted_done(*args):
        ops["finishes"] += 1
        done(*args)
    core.mover.submit, core.mover._on_done = counted_submit, counted_done
    t0 = time.perf_counter()
    res = core.lookup("c", "full", [h(k) for k in range(n)])
    assert core.wait_ready(res.lease, timeout=60)
    seconds = time.perf_counter() - t0
    assert len(res.hits) == n and all(int(g.gpu.tensor[b][0]) == k % 251 for k, b in enumerate(res.hits))
    core.release("c", res.lease)
    core.close()
    return seconds, ops


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--blocks", type=int, default=512)
    p.add_argument("--workers", type=int, default=1, help="kvd move_workers (0: inline)")
    p.add_argument("--repeats", type=int, default=7)
    args = p.parse_args()
    torch.set_num_threads(1)
    runs = [one(args.blocks, args.workers) for _ in range(args.repeats)]
    times = [t for t, _ in runs]
    print(json.dumps({"blocks": args.blocks, "workers": args.workers, "median_s": round(statistics.median(times), 4),
                      "all_s": [round(t, 4) for t in times], "jobs_at_finish": runs[-1][1]}))


if __name__ == "__main__":
    main()
