"""Host cost per decode step that grows with the context: ``host_step`` and ``extend_hashes`` for
``--seqs`` sequences of ``--context`` tokens, one new token each (docs/design/interfaces.md, "Engine").

    python -m tests.engine.context_cost_probe [--seqs 32 --context 10000]
"""
from __future__ import annotations

import argparse
import statistics
import time

from specd.engine.block_manager import BlockManager
from specd.engine.model_runner import host_step
from specd.engine.request import Request
from specd.engine.scheduler import ScheduledSeq
from specd.engine.sequence import Sequence
from specd.sampling_params import SamplingParams


class NoSource(BlockManager):
    def __init__(self):              # extend_hashes needs only the block size and the hash root
        self.block_size, self.root = 16, b"r" * 16


def decoding(count: int, context: int) -> list[Sequence]:
    seqs = []
    for i in range(count):
        seq = Sequence(Request(f"r{i}", list(range(context + i)), SamplingParams(max_tokens=64)), None, None)
        seq.output_ids = list(range(20))
        seq.num_computed_tokens = seq.num_tokens - 1
        seq.block_table = list(range((seq.num_tokens + 15) // 16))
        seqs.append(seq)
    return seqs


def median_ms(fn, repeats: int = 200) -> float:
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return 1e3 * statistics.median(times)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m tests.engine.context_cost_probe", description=__doc__.splitlines()[0])
    p.add_argument("--seqs", type=int, default=32)
    p.add_argument("--context", type=int, default=10_000)
    args = p.parse_args(argv)
    seqs = decoding(args.seqs, args.context)
    batch = [ScheduledSeq(s, 1) for s in seqs]
    print(f"host_step: median {median_ms(lambda: host_step(batch, 16)):.3f} ms")
    blocks = NoSource()
    for seq in seqs:
        blocks.extend_hashes(seq)

    def one_token_each():
        for seq in seqs:
            seq.output_ids.append(0)
            blocks.extend_hashes(seq)

    print(f"extend_hashes, one new token each: median {median_ms(one_token_each):.3f} ms")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
