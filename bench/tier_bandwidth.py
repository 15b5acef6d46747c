"""Tier movement on the real machine: kvd's own pools, block by block, as its mover copies them.

    python -m bench tier-bandwidth --out DIR [--block-bytes 196608,2359296] [--blocks 256]

For each block size (defaults: one block of Qwen2.5-0.5B and of Qwen3-8B KV at 16 tokens) and each
direction kvd moves blocks (GPU->DRAM demotion, DRAM->GPU promotion, DRAM->NVMe demotion, NVMe->GPU
and NVMe->DRAM promotion), the GB/s of ``kvd.tiers.move`` one block at a time, and of one large
transfer of the same bytes for reference. Then overlap: a fixed matmul loop on the default stream alone,
and with a mover thread copying DRAM->GPU on its own side stream at the same time (kvd/mover.py): the
compute slowdown and the copy rate while overlapped. NVMe goes through kvikio when it imports (which,
without GPUDirect Storage, runs in compatibility mode: POSIX reads into a bounce buffer), else POSIX.
Writes tier_bandwidth.json and tier_bandwidth.md.
"""
from __future__ import annotations

import argparse
import json
import tempfile
import threading
import time
from pathlib import Path

import torch

from kvd.mover import side_stream
from kvd.tiers import BlockMeta, move
from kvd.tiers.dram import DramPool
from kvd.tiers.gpu import GpuPool
from kvd.tiers.nvme import NvmePool


def _rate(nbytes: int, seconds: float) -> float:
    return nbytes / seconds / 1e9


def _timed(fn) -> float:
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    fn()
    torch.cuda.synchronize()
    return time.perf_counter() - t0


def directions(gpu, dram, nvme, blocks: int, block_bytes: int) -> dict:
    meta = BlockMeta(b"\x00" * 16, None, 0)
    pairs = {"gpu->dram": (gpu, dram), "dram->gpu": (dram, gpu), "dram->nvme": (dram, nvme),
             "nvme->gpu": (nvme, gpu), "nvme->dram": (nvme, dram), "gpu->nvme": (gpu, nvme)}
    out = {}
    for name, (src, dst) in pairs.items():
        move(src, 0, dst, 0, meta)                                   # warm (first touch, kvikio handle)
        s = _timed(lambda: [move(src, i, dst, i, meta) for i in range(blocks)])
        out[name] = {"GBps_per_block": _rate(blocks * block_bytes, s), "seconds": s}
    big = torch.empty(blocks * block_bytes, dtype=torch.uint8, device="cuda")
    host = dram.tensor[:blocks].reshape(-1)
    out["dram->gpu"]["GBps_one_transfer"] = _rate(big.numel(), _timed(lambda: big.copy_(host, non_blocking=True)))
    out["gpu->dram"]["GBps_one_transfer"] = _rate(big.numel(), _timed(lambda: host.copy_(big, non_blocking=True)))
    return out


def overlap(gpu, dram, blocks: int, block_bytes: int, seconds: float = 2.0) -> dict:
    """Compute alone vs compute with a side-stream promotion thread running."""
    a = torch.randn(4096, 4096, device="cuda", dtype=torch.bfloat16)
    meta = BlockMeta(b"\x00" * 16, None, 0)

    def compute(n: int) -> float:
        return _timed(lambda: [a @ a for _ in range(n)])

    n = 50
    while compute(n) < seconds / 4:
        n *= 2
    alone = min(compute(n) for _ in range(3))
    stop = threading.Event()
    copied = [0, 0.0]

    def mover() -> None:
        side_stream()
        t0 = time.perf_counter()
        i = 0
        while not stop.is_set():
            move(dram, i % blocks, gpu, i % blocks, meta)
            i += 1
        copied[0], copied[1] = i, time.perf_counter() - t0

    th = threading.Thread(target=mover)
    th.start()
    time.sleep(0.2)
    together = compute(n)
    stop.set()
    th.join()
    return {"matmuls": n, "compute_alone_s": alone, "compute_with_copies_s": together,
            "compute_slowdown": together / alone, "copy_GBps_while_overlapped": _rate(copied[0] * block_bytes, copied[1])}


def add_arguments(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--block-bytes", default="196608,2359296", help="comma-separated block sizes in bytes")
    ap.add_argument("--blocks", type=int, default=256, help="blocks moved per measurement")
    ap.add_argument("--nvme-dir", type=Path, default=None, help="where the NVMe slab goes (default: a temp dir)")


def run(args: argparse.Namespace) -> int:
    if not torch.cuda.is_available():
        raise SystemExit("tier-bandwidth needs a GPU")
    args.out.mkdir(parents=True, exist_ok=True)
    try:
        import kvikio  # type: ignore[import-not-found]  # noqa: F401
        nvme_io = "kvikio (compatibility mode: no GPUDirect Storage here)"
    except Exception as exc:  # noqa: BLE001 - any import failure means POSIX
        nvme_io = f"POSIX (kvikio not importable: {type(exc).__name__})"
    result: dict = {"device": torch.cuda.get_device_name(), "nvme_io": nvme_io, "blocks": args.blocks, "sizes": {}}
    for bb in (int(x) for x in args.block_bytes.split(",")):
        with tempfile.TemporaryDirectory(dir=args.nvme_dir) as tmp:
            run = Path(tmp)
            gpu = GpuPool("tb", args.blocks, bb, "cuda", run)
            dram = DramPool("tb", args.blocks, bb, "cuda", run)
            nvme = NvmePool(run / "nvme", "tb", args.blocks, bb)
            try:
                res = {"dram_pinned": dram.pinned, "directions": directions(gpu, dram, nvme, args.blocks, bb),
                       "overlap": overlap(gpu, dram, args.blocks, bb)}
            finally:
                for p in (gpu, dram, nvme):
                    p.close()
        result["sizes"][str(bb)] = res
        print(bb, json.dumps(res), flush=True)
    (args.out / "tier_bandwidth.json").write_text(json.dumps(result, indent=1))
    lines = [f"# Tier movement ({result['device']}, NVMe I/O: {nvme_io})", "",
             "| block bytes | direction | GB/s block by block | GB/s one transfer |", "|---|---|---|---|"]
    for bb, res in result["sizes"].items():
        for name, d in res["directions"].items():
            one = d.get("GBps_one_transfer")
            lines.append(f"| {bb} | {name} | {d['GBps_per_block']:.2f} | {'' if one is None else f'{one:.2f}'} |")
    lines += ["", "| block bytes | compute slowdown with side-stream copies | copy GB/s meanwhile |", "|---|---|---|"]
    for bb, res in result["sizes"].items():
        o = res["overlap"]
        lines.append(f"| {bb} | {o['compute_slowdown']:.3f}× | {o['copy_GBps_while_overlapped']:.2f} |")
    (args.out / "tier_bandwidth.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0
