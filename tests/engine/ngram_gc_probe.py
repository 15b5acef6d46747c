"""What prompt lookup's index costs the host, with tuple keys (session 6's first index) and with the
packed integer keys it has now, beside a serving process's heap of long-lived objects.

    python -m tests.engine.ngram_gc_probe --runs 60

Each run is a closed-loop batch: ``--requests`` indexes built over ``--prompt`` random tokens, then
``--steps`` steps of one new token each (sync + propose). Garbage-collector time is read with
``gc.callbacks``. Why: on the H200 (docs/results/speedup.md, session 6, run M) a resting ngram-gated
step at c = 32 cost ~1.2 ms more than a plain one, against ~0.15 ms of ngram host work on the CPU probe;
a tuple per n-gram is a container the collector tracks, an int is not.
"""
from __future__ import annotations

import argparse
import gc
import random
import time

import specd.drafter.ngram_index as ni
from specd.drafter.ngram_index import NgramIndex


class TupleKeyedIndex(NgramIndex):
    """The first index (b595818): a tuple of tokens per n-gram, registered one window at a time."""

    def _register(self, upto: int) -> None:
        tokens, last = self.tokens, self.last
        for e in range(self.registered + 1, upto + 1):
            for n in range(1, min(self.n_max, e) + 1):
                last[n][tuple(tokens[e - n:e])] = e
        self.registered = max(self.registered, upto)

    def propose(self) -> list[int]:
        tokens, size = self.tokens, len(self.tokens)
        for n in range(min(self.n_max, size - 1), 0, -1):
            e = self.last[n].get(tuple(tokens[size - n:]))
            if e is not None:
                return tokens[e:e + self.gamma]
        return []


def measure(make, prompts: list[list[int]], runs: int, steps: int) -> tuple[float, float, int]:
    """(seconds in all, seconds in the collector, collections) for ``runs`` closed-loop runs."""
    spent, count, started = [0.0], [0], [0.0]

    def on_gc(phase, info):
        if phase == "start":
            started[0] = time.perf_counter()
        else:
            spent[0] += time.perf_counter() - started[0]
            count[0] += 1

    gc.callbacks.append(on_gc)
    try:
        t0 = time.perf_counter()
        for _ in range(runs):
            indexes = [make() for _ in prompts]
            for index, prompt in zip(indexes, prompts):
                index.sync(prompt, [])
            for step in range(steps):
                out = list(range(step + 1))
                for index, prompt in zip(indexes, prompts):
                    index.sync(prompt, out)
                    index.propose()
            del indexes
        return time.perf_counter() - t0, spent[0], count[0]
    finally:
        gc.callbacks.remove(on_gc)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m tests.engine.ngram_gc_probe", description=__doc__.splitlines()[0])
    p.add_argument("--runs", type=int, default=60)
    p.add_argument("--requests", type=int, default=32)
    p.add_argument("--prompt", type=int, default=700, help="prompt tokens per request")
    p.add_argument("--steps", type=int, default=48)
    p.add_argument("--heap", type=int, default=2_000_000, help="long-lived container objects kept alive")
    args = p.parse_args(argv)
    ni.SCAN_TOKENS = 0     # the index for every history (since session 7 short ones are scanned instead)
    heap = [[i] for i in range(args.heap)]     # noqa: F841 (kept alive: the collector scans it)
    gc.collect()
    rng = random.Random(0)
    prompts = [[rng.randrange(150_000) for _ in range(args.prompt)] for _ in range(args.requests)]
    for name, make in (("tuple keys", lambda: TupleKeyedIndex(4, 32, 151_936)),
                       ("int keys", lambda: NgramIndex(4, 32, 151_936))):
        total, collector, collections = measure(make, prompts, args.runs, args.steps)
        print(f"{name}: {1e3 * total:.0f} ms in all, {1e3 * collector:.0f} ms in {collections} collections")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
