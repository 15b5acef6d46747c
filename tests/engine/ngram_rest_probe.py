"""What a resting gated-ngram step costs on the host with real prompts: every decoding request's index
synced and asked for a proposal (the gate decides after the lookup), for the first turns of each workload.

    python -m tests.engine.ngram_rest_probe --model models/qwen2.5-coder-0.5b-instruct-q4_k_m.gguf \\
        --sessions /tmp/qs/qs1000 --requests 32 --steps 128 --runs 5

Each run: ``--requests`` first-turn prompts of a workload's eval sessions (chat template, tools included,
as ``bench speedup`` builds them), then ``--steps`` steps of one new token each, drawn from the request's
own prompt (there is no model on the CPU machine; copied tokens make lookups find drafts, as code and
extraction answers do). Prints the median ms a step over the runs. Why: on the H100 (session 44, run DS)
the gated ngram row on coding at turn lengths drafted 6-20 steps a run and still ran 0.91-0.93× `none`.
Session 44, CPU machine, three invocations: 0.13-0.36 ms a step at 32 requests (coding 0.16-0.28; the
2-core machine is noisy), every lookup finding a draft.
"""
from __future__ import annotations

import argparse
import random
import statistics
import time
from pathlib import Path

from bench.workloads.format import prompt_messages, read_sessions
from specd.drafter.ngram_index import NgramIndex
from specd.loader.gguf import gguf_tokenizer
from specd.loader.gguf_file import GGUFFile

WORKLOADS = ("coding", "creative", "extraction", "knowledge", "support")


def first_turns(tokenizer, path: Path, n: int) -> list[list[int]]:
    sessions = [s for s in read_sessions(path) if s.split == "eval"]
    out = []
    for i in range(n):
        s = sessions[i % len(sessions)]
        extra = {"tools": s.tools} if s.tools else {}
        out.append(tokenizer.encode_chat(prompt_messages(s, 0, []), **extra))
    return out


def one_run(prompts: list[list[int]], steps: int, vocab: int, seed: int) -> tuple[float, float]:
    """(seconds a step, share of lookups that found a draft)."""
    rng = random.Random(seed)
    indexes = [NgramIndex(4, 7, vocab) for _ in prompts]
    outputs: list[list[int]] = [[] for _ in prompts]
    for index, prompt in zip(indexes, prompts):
        index.sync(prompt, [])
        index.propose()
    found = 0
    t0 = time.perf_counter()
    for _ in range(steps):
        for index, prompt, output in zip(indexes, prompts, outputs):
            output.append(prompt[rng.randrange(len(prompt))])
            index.sync(prompt, output)
            found += bool(index.propose())
    return (time.perf_counter() - t0) / steps, found / (steps * len(prompts))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", required=True, help="the GGUF whose tokenizer builds the prompts")
    p.add_argument("--sessions", required=True, type=Path, help="a folder of <workload>.eval.jsonl files")
    p.add_argument("--requests", type=int, default=32)
    p.add_argument("--steps", type=int, default=128)
    p.add_argument("--runs", type=int, default=5)
    a = p.parse_args(argv)
    tokenizer = gguf_tokenizer(GGUFFile(a.model))
    print("| workload | median prompt tokens | ms a resting step | lookups that found a draft |")
    print("|---|---|---|---|")
    for w in WORKLOADS:
        prompts = first_turns(tokenizer, a.sessions / f"{w}.eval.jsonl", a.requests)
        runs = [one_run(prompts, a.steps, tokenizer.vocab_size, seed) for seed in range(a.runs)]
        print(f"| {w} | {statistics.median(map(len, prompts)):.0f} | {statistics.median(r[0] for r in runs) * 1e3:.3f} "
              f"| {statistics.median(r[1] for r in runs):.0%} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
