"""``python -m bench kv-trace``: replay a Mooncake trace through a real kvd over IPC.

For every (policy, capacity, dram capacity) it starts a fresh kvd process (own temp run dir, GPU
capacity = fraction x unique blocks of the trace, 512-token blocks to match the trace's hash unit,
64-byte blocks so memory stays small) and replays the requests as fast as one client can: lookup the
chain; on a partial hit allocate and commit the missing blocks; release.

Time: the daemon runs on the wall clock, and the trace spans about an hour. The replay is paced at
``--speedup`` x trace time (request i is sent at ts_i / speedup), and kvd's time constant (half_life_s)
is divided by the same factor, so temperature decays per trace-second as it would live. Replaying
unpaced (``--speedup 0``) would squeeze an hour into seconds and make every block look equally
recent to a decaying-frequency policy. The table reports how far the replay fell behind its schedule.

Token hit rate = sum over requests of min(hit blocks x 512, input_length) / sum of input_length
(the definition under which an LRU at 10% gives 28.4% and an infinite cache 37.4%).

``--micro`` adds the control-plane costs: p50/p99 of a 64-block lookup that fully hits, of one that
fully misses (the overhead a prefix cache adds at 0% hit rate), and of an empty round trip.
"""
from __future__ import annotations

import argparse
import json
import os
import shlex
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Optional

from bench.kvd_process import KvdProcess
from bench.mooncake import TRACE_BLOCK_TOKENS, TraceHasher, TraceRequest, ideal_token_hit_rate, read_trace, unique_blocks
from bench.stats import percentile
from client.kvd_client import KvdClient, OutOfBlocks
from kvd import protocol as P
from kvd.config import KvdConfig

GROUP = "full"
DEFAULT_TRACE = Path(__file__).resolve().parents[2] / "shared/data/traces/mooncake_conversation_trace.jsonl"
POLICIES = ("lru", "lru-offload", "reuse")


def _floats(text: str) -> list[float]:
    vals = [float(v) for v in text.split(",") if v.strip()]
    if not vals or any(not 0 <= v <= 1000 for v in vals):
        raise argparse.ArgumentTypeError(f"bad fraction list {text!r}")
    return vals


def _policies(text: str) -> list[str]:
    vals = [v.strip() for v in text.split(",") if v.strip()]
    bad = [v for v in vals if v not in POLICIES]
    if bad or not vals:
        raise argparse.ArgumentTypeError(f"unknown policy {bad or text!r}; choose from {POLICIES}")
    return vals


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--trace", type=Path, default=DEFAULT_TRACE, help="Mooncake jsonl trace")
    p.add_argument("--capacity", type=_floats, default=[0.1],
                   help="GPU capacity as a fraction of the trace's unique blocks; a comma list runs each")
    p.add_argument("--dram-capacity", type=_floats, default=[0.0],
                   help="DRAM tier capacity, same unit (0: no DRAM tier); a comma list runs each")
    p.add_argument("--policy", type=_policies, default=list(POLICIES),
                   help="eviction policy or comma list of them: lru, lru-offload, reuse")
    p.add_argument("--out", type=Path, default=None, help="write results as JSON here")
    p.add_argument("--limit", type=int, default=None, help="replay only the first N requests")
    p.add_argument("--block-bytes", type=int, default=64, help="bytes per block in kvd (tiny: no KV is moved)")
    p.add_argument("--speedup", type=float, default=150.0,
                   help="replay at this multiple of trace time and divide half_life_s by it (0: unpaced)")
    p.add_argument("--micro", action="store_true", help="also measure 64-block hit/miss lookup latency")
    p.add_argument("--micro-iters", type=int, default=2000)
    p.add_argument("--no-progress", action="store_true", help="no tqdm bar")


@dataclass
class ReplayResult:
    policy: str
    capacity: float
    dram_capacity: float
    gpu_blocks: int
    dram_blocks: int
    requests: int
    token_hit_rate: float
    hit_blocks: int
    lookups_per_s: float
    requests_per_s: float
    lookup_p50_us: float
    lookup_p99_us: float
    out_of_blocks: int
    max_lag_s: float
    kvd_stats: dict[str, Any]


def replay_request(client: KvdClient, hashes: list[bytes], req: TraceRequest) -> tuple[int, float, bool]:
    """One request: (hit blocks, lookup seconds, whether allocation ran out of blocks)."""
    t0 = time.perf_counter()
    hit = client.lookup(GROUP, hashes)
    dt = time.perf_counter() - t0
    k = hit.num_hits
    ops: list[P.Op] = []
    starved = False
    if k < len(hashes):
        try:
            lease, blocks = client.allocate(GROUP, len(hashes) - k)
        except OutOfBlocks:
            starved = True
        else:
            parents = [hashes[k - 1] if k else None, *hashes[k:-1]]
            ops += [P.Commit(lease=lease, blocks=list(zip(blocks, hashes[k:], parents))), P.Release(lease=lease)]
    if hit.lease:
        ops.append(P.Release(lease=hit.lease))
    if ops:
        for r in client.batch(ops):
            if isinstance(r, Exception):
                raise r
    return k, dt, starved


def replay(client: KvdClient, trace: list[TraceRequest], chains: list[list[bytes]], progress: bool,
           label: str, speedup: float) -> dict[str, Any]:
    from tqdm import tqdm

    hit_tokens = total_tokens = hit_blocks = starved = 0
    lat: list[float] = []
    max_lag = 0.0
    t0 = time.perf_counter()
    start_ms = trace[0].timestamp_ms if trace else 0
    for req, hashes in tqdm(list(zip(trace, chains)), desc=label, disable=not progress, file=sys.stderr,
                            mininterval=1.0):
        if speedup > 0:
            due = t0 + (req.timestamp_ms - start_ms) / 1000 / speedup
            lag = time.perf_counter() - due
            if lag < 0:
                time.sleep(-lag)
            max_lag = max(max_lag, lag)
        k, dt, out = replay_request(client, hashes, req)
        lat.append(dt)
        hit_blocks += k
        hit_tokens += min(k * TRACE_BLOCK_TOKENS, req.input_length)
        total_tokens += req.input_length
        starved += out
    wall = time.perf_counter() - t0
    return {"token_hit_rate": hit_tokens / total_tokens, "hit_blocks": hit_blocks,
            "lookups_per_s": len(lat) / sum(lat), "requests_per_s": len(lat) / wall,
            "lookup_p50_us": percentile(lat, 50) * 1e6, "lookup_p99_us": percentile(lat, 99) * 1e6,
            "out_of_blocks": starved, "max_lag_s": max_lag}


def run_one(args: argparse.Namespace, trace: list[TraceRequest], chains: list[list[bytes]], policy: str,
            capacity: float, dram: float, uniq: int) -> ReplayResult:
    gpu_blocks = max(1, int(capacity * uniq))
    dram_blocks = int(dram * uniq)
    half_life = KvdConfig.model_fields["half_life_s"].default / (args.speedup or 1.0)
    with tempfile.TemporaryDirectory(prefix="kvd-bench-") as tmp:
        with KvdProcess(Path(tmp) / "run", policy=policy, gpu_blocks=gpu_blocks, dram_blocks=dram_blocks,
                        nvme_blocks=0, admission="none", max_groups=1, lease_ttl_s=600, half_life_s=half_life,
                        log_level="WARNING"):
            with KvdClient(Path(tmp) / "run", timeout_s=30) as client:
                client.attach(GROUP, args.block_bytes)
                label = f"{policy}@{capacity:g}" + (f"+dram{dram:g}" if dram else "")
                res = replay(client, trace, chains, not args.no_progress, label, args.speedup)
                stats = client.stats()
    return ReplayResult(policy, capacity, dram, gpu_blocks, dram_blocks, len(trace), kvd_stats=stats, **res)


def _pcts(samples: list[float]) -> dict[str, float]:
    return {"p50_us": percentile(samples, 50) * 1e6, "p99_us": percentile(samples, 99) * 1e6}


def _timed(fn: Any, iters: int) -> list[float]:
    out = []
    for _ in range(iters):
        t0 = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t0)
    return out


def micro(args: argparse.Namespace) -> dict[str, Any]:
    """64-block lookups against a warm kvd: all hit, all miss, and an empty round trip."""
    n = 64
    with tempfile.TemporaryDirectory(prefix="kvd-micro-") as tmp:
        run = Path(tmp) / "run"
        with KvdProcess(run, policy="reuse", gpu_blocks=4096, dram_blocks=0, nvme_blocks=0, max_groups=1,
                        lease_ttl_s=600, log_level="WARNING"), KvdClient(run) as client:
            client.attach(GROUP, args.block_bytes)
            chain = TraceHasher(16).chain(tuple(range(n)))
            lease, blocks = client.allocate(GROUP, n)
            client.commit(lease, list(zip(blocks, chain, [None, *chain[:-1]])))
            client.release(lease)
            iters = args.micro_iters
            hit_lat = []
            for _ in range(iters):
                t0 = time.perf_counter()
                r = client.lookup(GROUP, chain)
                hit_lat.append(time.perf_counter() - t0)
                if r.num_hits != n:
                    raise RuntimeError(f"warm 64-block chain hit only {r.num_hits} blocks")
                client.release(r.lease)
            misses = [[os.urandom(16) for _ in range(n)] for _ in range(iters)]
            it = iter(misses)
            miss_lat = _timed(lambda: client.lookup(GROUP, next(it)), iters)
            rtt_lat = _timed(client.heartbeat, iters)
    return {"blocks": n, "iters": iters, "hit_64": _pcts(hit_lat), "miss_64": _pcts(miss_lat),
            "empty_round_trip": _pcts(rtt_lat)}


def table(results: list[ReplayResult], ideal: float) -> str:
    head = f"{'policy':<12} {'gpu cap':>7} {'dram cap':>8} {'gpu blocks':>10} {'token hit':>9} " \
           f"{'lookups/s':>9} {'req/s':>7} {'p50 us':>7} {'p99 us':>7} {'max lag s':>9}"
    rows = [head, "-" * len(head)]
    for r in results:
        rows.append(f"{r.policy:<12} {r.capacity:>7.2f} {r.dram_capacity:>8.2f} {r.gpu_blocks:>10} "
                    f"{100 * r.token_hit_rate:>8.2f}% {r.lookups_per_s:>9.0f} {r.requests_per_s:>7.0f} "
                    f"{r.lookup_p50_us:>7.0f} {r.lookup_p99_us:>7.0f} {r.max_lag_s:>9.2f}")
    rows.append(f"ideal (infinite cache): {100 * ideal:.2f}%")
    return "\n".join(rows)


def run(args: argparse.Namespace) -> int:
    trace = read_trace(args.trace, args.limit)
    uniq = unique_blocks(trace)
    hasher = TraceHasher(TRACE_BLOCK_TOKENS)
    chains = [hasher.chain(r.hash_ids) for r in trace]
    ideal = ideal_token_hit_rate(trace)
    results = [run_one(args, trace, chains, policy, cap, dram, uniq)
               for cap in args.capacity for dram in args.dram_capacity for policy in args.policy]
    out: dict[str, Any] = {
        "command": "python -m bench " + " ".join(shlex.quote(a) for a in sys.argv[1:]),
        "trace": str(args.trace), "requests": len(trace), "unique_blocks": uniq,
        "ideal_token_hit_rate": ideal, "runs": [asdict(r) for r in results],
    }
    print(table(results, ideal))
    if args.micro:
        out["micro"] = m = micro(args)
        print(f"64-block lookup, all hit:  p50 {m['hit_64']['p50_us']:.0f} us  p99 {m['hit_64']['p99_us']:.0f} us")
        print(f"64-block lookup, all miss: p50 {m['miss_64']['p50_us']:.0f} us  p99 {m['miss_64']['p99_us']:.0f} us")
        print(f"empty round trip:          p50 {m['empty_round_trip']['p50_us']:.0f} us  "
              f"p99 {m['empty_round_trip']['p99_us']:.0f} us")
    if args.out:
        args.out.write_text(json.dumps(out, indent=2, default=str))
    return 0
