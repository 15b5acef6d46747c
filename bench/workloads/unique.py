"""Unique prompts: one-turn requests that share no KV block with each other, for the 0%-hit overhead.

What it measures: what a cache costs when it never pays (lookups that miss, commits of blocks nobody
reads again). Every prompt opens with its own random tag, the first thing in the system prompt, so even
block 0 (chat template header + tag) differs between requests and a prefix cache can hit nothing. The
body is a slice of a standard-library source file (local, no corpus needed) at a random offset; the
answer length is fixed, greedy, so every configuration does the same work.
"""
from __future__ import annotations

import platform
import random

from bench.workloads.format import Message, Sampling, Session, Turn
from bench.workloads.profile import BuildOptions, stdlib_root, stdlib_sources

WORKLOAD = "unique"
DEFAULT_MAX_TOKENS = 64
TAG_CHARS = 12  # hex digits: the first block differs even at one character per token


def tag(rng: random.Random) -> str:
    return "".join(rng.choice("0123456789abcdef") for _ in range(TAG_CHARS))


def make_session(index: int, opts: BuildOptions, rng: random.Random, files: list) -> Session:
    path = rng.choice(files)
    text = path.read_text(encoding="utf-8", errors="replace")
    start = rng.randrange(max(1, len(text) - opts.file_chars))
    body = opts.clip(text[start:start + opts.file_chars])
    rel = path.relative_to(stdlib_root()).as_posix()
    return Session(
        id=f"{WORKLOAD}-{opts.split}-{index:05d}", workload=WORKLOAD, split=opts.split, arrival_s=0.0,
        system=f"{tag(rng)} Explain code.",
        turns=[Turn(messages=[Message(role="user", content=body)],
                    max_tokens=opts.answer_tokens(DEFAULT_MAX_TOKENS))],
        sampling=Sampling(temperature=0.0, top_p=1.0, top_k=0),
        meta={"corpus": "stdlib", "python": platform.python_version(), "files": [f"Lib/{rel}"]})


def build(opts: BuildOptions) -> list[Session]:
    rng = opts.rng(WORKLOAD)
    files = [p for p in stdlib_sources() if p.stat().st_size >= opts.file_chars]
    return [make_session(i, opts, rng, files) for i in range(opts.sessions)]
