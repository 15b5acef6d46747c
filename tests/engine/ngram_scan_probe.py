"""What prompt lookup costs a closed-loop run of resting requests: the index built for every prompt
(session 6) against scanning short histories (session 7, ``SCAN_TOKENS``).

    python -m tests.engine.ngram_scan_probe --requests 32 --steps 58 --lengths 300,700,3000 --runs 15

Each run is one batch: ``--requests`` histories of a prompt of random Qwen-sized token ids, synced and
asked for a proposal at every one of ``--steps`` steps, one new token each, as the engine does for a
gated ngram request whether or not its cell rests. Both ways run alternately in the same process; the
table gives median milliseconds per run and per step. Why: on the H200 (run N) a gated ngram row at
c = 32 that never drafted still ran 15-20% slower than plain decoding.
"""
from __future__ import annotations

import argparse
import random
import statistics
import time

import specd.drafter.ngram_index as ni

VOCAB = 151_936


def one_run(prompts: list[list[int]], steps: int, scan_tokens: int) -> tuple[float, float]:
    """(seconds to the first proposals: the prompts' sync, seconds of the steps after)."""
    ni.SCAN_TOKENS = scan_tokens
    t0 = time.perf_counter()
    indexes = [ni.NgramIndex(4, 7, VOCAB) for _ in prompts]
    for index, prompt in zip(indexes, prompts):
        index.sync(prompt, [])
        index.propose()
    t1 = time.perf_counter()
    output: list[int] = []
    for step in range(steps):
        output.append(step % 97)
        for index, prompt in zip(indexes, prompts):
            index.sync(prompt, output)
            index.propose()
    return t1 - t0, time.perf_counter() - t1


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--requests", type=int, default=32)
    p.add_argument("--steps", type=int, default=58)
    p.add_argument("--lengths", default="300,700,3000")
    p.add_argument("--runs", type=int, default=15)
    a = p.parse_args(argv)
    default = ni.SCAN_TOKENS
    print("| prompt tokens | way | first proposals ms | per step ms | run ms |")
    print("|---|---|---|---|---|")
    for length in map(int, a.lengths.split(",")):
        rng = random.Random(length)
        prompts = [[rng.randrange(VOCAB) for _ in range(length)] for _ in range(a.requests)]
        got: dict[str, list[tuple[float, float]]] = {"index": [], "scan": []}
        for _ in range(a.runs):
            got["index"].append(one_run(prompts, a.steps, 0))
            got["scan"].append(one_run(prompts, a.steps, default))
        for way, runs in got.items():
            first = statistics.median(r[0] for r in runs) * 1e3
            step = statistics.median(r[1] for r in runs) * 1e3 / a.steps
            total = statistics.median(r[0] + r[1] for r in runs) * 1e3
            print(f"| {length} | {way} | {first:.2f} | {step:.3f} | {total:.1f} |")
    ni.SCAN_TOKENS = default
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
