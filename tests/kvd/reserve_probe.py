"""Where an engine on kvd allocates blocks blocking: each `BlockManager._refill` call's caller, the reserve
it found, and every posted refill (`refill_ahead`), for unique prompts served closed-loop.

Why: at a 0% hit rate on the H200 (session 9, run Z) admission waited on 0.2 `allocate` round trips per
request. Session 10 found them here all at admission right after a wave of requests finished: the last
`_finish` of a batch releases the whole reserve (docs/design/kvd.md, "Session 10"). Not a test (pytest does
not collect it):

    python tests/kvd/reserve_probe.py [--requests 24] [--concurrency 8]
"""
from __future__ import annotations

import argparse
import collections
import random
import tempfile
import traceback
from pathlib import Path

import torch

from bench.kvd_process import KvdProcess
from specd.engine.config import EngineConfig
from specd.engine.engine import SpecEngine
from specd.engine.request import Request
from specd.sampling_params import SamplingParams

WORDS = "the a little girl boy dog cat sun park ball red big saw played ran happy sad tree house".split()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--requests", type=int, default=24)
    p.add_argument("--concurrency", type=int, default=8)
    p.add_argument("--max-tokens", type=int, default=16)
    args = p.parse_args()
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as tmp, KvdProcess(Path(tmp) / "kvd", gpu_bytes=64 << 20, dram_bytes=0) as kvd:
        engine = SpecEngine.from_config(EngineConfig(kvd_run_dir=kvd.run_dir, max_num_seqs=args.concurrency))
        bm = engine.blocks
        callers: collections.Counter[str] = collections.Counter()
        found: list[tuple[int, int]] = []          # (blocks needed, reserve found) per blocking refill
        posted: list[int] = []                     # blocks asked per posted refill
        refill, ahead = bm._refill, bm.refill_ahead

        def counted_refill(n: int, extra: int = 0) -> None:
            callers[" <- ".join(f.name for f in traceback.extract_stack(limit=6)[-5:-1])] += 1
            found.append((n, len(bm._reserve)))
            refill(n, extra)

        def counted_ahead(expected: int) -> None:
            before = bm._in_flight
            ahead(expected)
            if bm._in_flight and not before:
                posted.append(bm._in_flight)

        bm._refill, bm.refill_ahead = counted_refill, counted_ahead
        rng = random.Random(0)
        prompts = [engine.tokenizer.encode(" ".join(rng.choice(WORDS) for _ in range(rng.randint(40, 120))))
                   for _ in range(args.requests)]
        queue, inflight = list(enumerate(prompts)), 0
        while queue or inflight:
            while queue and inflight < args.concurrency:
                i, ids = queue.pop(0)
                engine.add_request(Request(f"r{i}", ids, SamplingParams(temperature=0.0, max_tokens=args.max_tokens,
                                                                        ignore_eos=True)))
                inflight += 1
            inflight -= sum(out.finished for out in engine.step())
        print(f"{args.requests} requests; blocking refills {len(found)}, posted {len(posted)}")
        print("blocking refills by caller:", dict(callers))
        print("(blocks needed beyond the reserve, reserve found):", found)


if __name__ == "__main__":
    main()
