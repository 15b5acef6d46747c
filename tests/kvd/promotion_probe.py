"""Promotion latency of one lease: N blocks in DRAM promoted back to the GPU tier, timed from the lookup to
wait_ready answering (docs/design/kvd.md, "Batched promotions"). On this CPU machine the "GPU" tier is a CPU
tensor, so the time is mostly the memory copy; the jobs and lock trips at finish are the part that carries
over to a GPU.

With ``--device cuda`` it also times the bare copies the promotion is made of (``--raw``): a kvd DRAM pool
(/dev/shm, cudaHostRegister'ed) against ``pin_memory`` and pageable tensors, as one copy and as one copy per
block, alone and beside a device-to-host copy of the same size on another stream (a demotion). Why: served
promotions at the 8B shape ran at 22-32 GB/s (docs/results/kv.md, session 20) against the 55 GB/s measured
for pinned copies; this says whether the copy path or the load around it costs the difference.

    python -m tests.kvd.promotion_probe --blocks 512 --workers 1 --repeats 7
    python -m tests.kvd.promotion_probe --device cuda --block-bytes 2359296 --blocks 313 --raw   # 8B shape
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


def one(n: int, workers: int, device: str = "cpu", block_bytes: int = BLOCK_BYTES) -> tuple[float, dict[str, int]]:
    """One cold promotion of an n-block chain; returns (seconds, jobs submitted and finished)."""
    core = KvdCore(KvdConfig(run_dir=Path(tempfile.mkdtemp()) / "run", policy="lru-offload", admission="none",
                             gpu_blocks=n + 64, dram_blocks=n + 64, move_workers=workers, device=device,
                             clean_low=0.0, clean_high=0.0))
    core.attach("c", "full", block_bytes)
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


def _gbps(nbytes: int, seconds: list[float]) -> dict[str, float]:
    return {"p50_gbps": round(nbytes / statistics.median(seconds) / 1e9, 2),
            "min_gbps": round(nbytes / max(seconds) / 1e9, 2), "max_gbps": round(nbytes / min(seconds) / 1e9, 2)}


def raw_rates(n: int, block_bytes: int, repeats: int) -> dict[str, object]:
    """Host-to-GPU copy rates of n blocks by source kind and copy shape, on a side stream as kvd's mover
    copies; 'beside_d2h' runs a device-to-host copy of the same bytes on a second stream at the same time."""
    from kvd.tiers.dram import DramPool
    dev = torch.device("cuda")
    run_dir = Path(tempfile.mkdtemp())
    dram = DramPool("probe", n, block_bytes, "cuda", run_dir)
    sources = {"dram_pool": dram.tensor, "pin_memory": torch.empty((n, block_bytes), dtype=torch.uint8, pin_memory=True),
               "pageable": torch.empty((n, block_bytes), dtype=torch.uint8)}
    gpu = torch.empty((n, block_bytes), dtype=torch.uint8, device=dev)
    back = torch.empty((n, block_bytes), dtype=torch.uint8, pin_memory=True)
    gpu2 = torch.empty((n, block_bytes), dtype=torch.uint8, device=dev)
    s1, s2 = torch.cuda.Stream(dev), torch.cuda.Stream(dev)
    order = list(range(n))[::-1]                 # per block: sources read out of order, as scattered slots are
    out: dict[str, object] = {"blocks": n, "block_bytes": block_bytes, "dram_pool_pinned": dram.pinned,
                              "dram_pool_is_pinned": bool(dram.tensor.is_pinned())}

    def time_it(src: torch.Tensor, per_block: bool, beside_d2h: bool) -> list[float]:
        secs = []
        for _ in range(repeats + 1):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            if beside_d2h:
                with torch.cuda.stream(s2):
                    back.copy_(gpu2, non_blocking=True)
            with torch.cuda.stream(s1):
                if per_block:
                    for i, j in enumerate(order):
                        gpu[i].copy_(src[j], non_blocking=True)
                else:
                    gpu.copy_(src, non_blocking=True)
            s1.synchronize()
            secs.append(time.perf_counter() - t0)
            torch.cuda.synchronize()
        return secs[1:]                           # the first warms the path
    for name, src in sources.items():
        for per_block in (False, True):
            for beside in (False, True):
                key = f"{name}/{'per_block' if per_block else 'one_copy'}{'/beside_d2h' if beside else ''}"
                out[key] = _gbps(n * block_bytes, time_it(src, per_block, beside))
    dram.close()
    return out


def issue_times(n: int, block_bytes: int, repeats: int, run_blocks: int = 7,
                to_gpu: bool = True) -> dict[str, object]:
    """Where a served batch's copy time goes (session 24: kvd's counters said 60-80% of a promotion's copy
    time is spent *issuing* its ~46 copies of ~7 blocks, before the stream wait). Times issuing and the wait
    apart for copies from kvd's DRAM pool: one ``copy_`` per run (``queue_runs_reference``) and one foreach
    call for the batch (``queue_batched``, what ``queue_runs`` does on a GPU), alone and beside a Python thread
    that keeps the GIL busy (as kvd's server loop and cleaner do), at Python's default switch interval (5 ms)
    and at 0.5 ms (``KvdConfig.gil_switch_ms``). Slow issuing alone would mean the copies are not
    asynchronous; slow only beside the thread means the GIL. ``to_gpu=False`` times the other direction, GPU to
    DRAM, as the cleaner's demotions issue it; every cell checks the copied bytes."""
    import sys
    import threading
    from kvd.tiers.base import queue_batched, queue_runs_reference, slot_runs, wait_stream
    from kvd.tiers.dram import DramPool
    dev = torch.device("cuda")
    dram = DramPool("issue", n, block_bytes, "cuda", Path(tempfile.mkdtemp()))
    gpu = torch.empty((n, block_bytes), dtype=torch.uint8, device=dev)
    # runs of ``run_blocks`` adjacent slots on both sides, the runs in scattered order
    starts = list(range(0, n - run_blocks + 1, run_blocks))[::-1]
    dst = [i for k, st in enumerate(starts) for i in range(k * run_blocks, k * run_blocks + run_blocks)]
    src = [i for st in starts for i in range(st, st + run_blocks)]
    if to_gpu:
        into, fro, d_slots, s_slots = gpu, dram.tensor, dst, src
    else:
        gpu.random_(0, 256)
        into, fro, d_slots, s_slots = dram.tensor, gpu, src, dst
    runs = slot_runs(d_slots, s_slots)
    issuers = {"loop": lambda: queue_runs_reference(into, d_slots, fro, s_slots),
               "batched": lambda: queue_batched(into, fro, runs, non_blocking=True)}
    side = torch.cuda.Stream(dev)
    out: dict[str, object] = {"direction": "host_to_gpu" if to_gpu else "gpu_to_host",
                              "blocks": len(src), "run_blocks": run_blocks, "copies": len(runs),
                              "block_bytes": block_bytes, "dram_pool_is_pinned": bool(dram.tensor.is_pinned())}
    stop = threading.Event()

    def busy() -> None:
        x = 0
        while not stop.is_set():
            x += 1

    default_interval = sys.getswitchinterval()
    for interval in (default_interval, 0.0005):
        sys.setswitchinterval(interval)
        for with_busy in (False, True):
            for name, issue_all in issuers.items():
                t = threading.Thread(target=busy, daemon=True) if with_busy else None
                if t is not None:
                    stop.clear()
                    t.start()
                issue, wait = [], []
                for rep in range(repeats + 1):
                    torch.cuda.synchronize()
                    with torch.cuda.stream(side):
                        t0 = time.perf_counter()
                        issue_all()
                        t1 = time.perf_counter()
                        wait_stream(gpu)
                        t2 = time.perf_counter()
                    if rep in (0, repeats):   # the first and last copy of each cell: the bytes arrived
                        if not all(torch.equal(into[d : d + k].cpu(), fro[s_ : s_ + k].cpu()) for d, s_, k in runs):
                            raise AssertionError(f"{name}: copied bytes differ")
                        into.zero_()
                    issue.append(t1 - t0)
                    wait.append(t2 - t1)
                if t is not None:
                    stop.set()
                    t.join()
                total = statistics.median([a + b for a, b in zip(issue[1:], wait[1:])])
                key = f"{name}/{'beside_busy_thread' if with_busy else 'alone'}/switch_{interval * 1e3:g}ms"
                out[key] = {"issue_ms_p50": round(1e3 * statistics.median(issue[1:]), 3),
                            "wait_ms_p50": round(1e3 * statistics.median(wait[1:]), 3),
                            "total_ms_p50": round(1e3 * total, 3),
                            "gbps_p50": round(len(src) * block_bytes / total / 1e9, 2)}
    sys.setswitchinterval(default_interval)
    dram.close()
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--blocks", type=int, default=512)
    p.add_argument("--workers", type=int, default=1, help="kvd move_workers (0: inline)")
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--device", default="cpu", help="kvd's device: cpu (the GPU tier is a CPU tensor) or cuda")
    p.add_argument("--block-bytes", type=int, default=BLOCK_BYTES,
                   help="bytes per block (196608: Qwen2.5-0.5B; 2359296: the Qwen3-8B shape)")
    p.add_argument("--raw", action="store_true", help="also time the bare copies (needs --device cuda)")
    p.add_argument("--issue", action="store_true",
                   help="also time issuing a batch's copies apart from waiting for them (needs --device cuda)")
    p.add_argument("--to-host", action="store_true",
                   help="with --issue: time GPU-to-DRAM copies (the cleaner's demotions) too")
    p.add_argument("--out", type=Path, help="also write the JSON here")
    args = p.parse_args()
    if (args.raw or args.issue) and args.device != "cuda":
        p.error("--raw and --issue time host-to-GPU copies: they need --device cuda")
    torch.set_num_threads(1)
    runs = [one(args.blocks, args.workers, args.device, args.block_bytes) for _ in range(args.repeats)]
    times = [t for t, _ in runs]
    res: dict[str, object] = {"blocks": args.blocks, "workers": args.workers, "device": args.device,
                              "block_bytes": args.block_bytes, "median_s": round(statistics.median(times), 4),
                              "all_s": [round(t, 4) for t in times], "jobs_at_finish": runs[-1][1],
                              "promotion": _gbps(args.blocks * args.block_bytes, times)}
    if args.raw:
        res["raw"] = raw_rates(args.blocks, args.block_bytes, args.repeats)
    if args.issue:
        res["issue"] = issue_times(args.blocks, args.block_bytes, args.repeats)
        if args.to_host:
            res["issue_to_host"] = issue_times(args.blocks, args.block_bytes, args.repeats, to_gpu=False)
    text = json.dumps(res, indent=1)
    print(text)
    if args.out:
        args.out.write_text(text)


if __name__ == "__main__":
    main()
