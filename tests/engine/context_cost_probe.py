"""Host cost per decode step that grows with the context or the answer, each against the way it was
done before (docs/design/interfaces.md, "Engine"): ``host_step`` and ``extend_hashes`` for ``--seqs``
sequences of ``--context`` tokens; writing their block tables (``write_tables`` against a tensor per
row); and detokenizing a ``--answer``-token answer (the windowed ``Detokenizer`` against the whole decode).

    python -m tests.engine.context_cost_probe [--seqs 32 --context 10000 --answer 1000 --model Q.gguf]
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch

from specd.engine.block_manager import BlockManager
from specd.engine.cuda_graphs import write_tables
from specd.engine.detokenizer import Detokenizer
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
    p.add_argument("--answer", type=int, default=1000, help="answer tokens to detokenize")
    p.add_argument("--model", default="models/stories260K.gguf", help="whose tokenizer detokenizes")
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

    tables = [s.block_table for s in seqs]
    dst = torch.zeros(len(tables), max(map(len, tables)), dtype=torch.int32)

    def per_row():
        for i, row in enumerate(tables):
            dst[i, : len(row)] = torch.tensor(row, dtype=torch.int32)

    print(f"block tables: a tensor per row {median_ms(per_row, 50):.3f} ms, "
          f"write_tables {median_ms(lambda: write_tables(dst, tables), 50):.3f} ms")

    from specd.loader.gguf import gguf_tokenizer
    from specd.loader.gguf_file import GGUFFile

    tok = gguf_tokenizer(GGUFFile(args.model))
    text = open(__file__).read() * 20
    ids = tok.encode(text, add_bos=False)[: args.answer]
    for incremental in (False, True):
        detok = Detokenizer(tok.decode, incremental=incremental)
        t0 = time.perf_counter()
        for i in ids:
            detok.add(i)
        name = "windowed" if incremental else "whole decode"
        print(f"detokenize {len(ids)} tokens, {name}: {1e3 * (time.perf_counter() - t0):.1f} ms")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
