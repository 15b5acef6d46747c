"""Reader for the Mooncake trace format (FAST'25, kvcache-ai/Mooncake).

Each line is ``{"timestamp": ms, "input_length": tokens, "output_length": tokens, "hash_ids": [...]}``
with one hash id per 512-token block of the prompt (the last one may be partial); equal ids are equal
block content. To replay it through kvd, each id becomes a fixed block of token ids, and the chain
hash of kvd.hashing runs over them. Why real chain hashes and not the ids themselves: the replay then
exercises the same hashing and commit-chain validation as a serving engine.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import numpy as np

from kvd.hashing import block_hash, namespace_root
from kvd.types import BlockHash

TRACE_BLOCK_TOKENS = 512  # the trace's hash unit
VOCAB = 151_936  # Qwen2.5's vocabulary, so the token ids look like a real model's


@dataclass(frozen=True)
class TraceRequest:
    timestamp_ms: int
    input_length: int
    output_length: int
    hash_ids: tuple[int, ...]


def read_trace(path: str | Path, limit: Optional[int] = None) -> list[TraceRequest]:
    """The first ``limit`` requests (all by default), in file order."""
    out: list[TraceRequest] = []
    with open(path) as f:
        for line in f:
            if limit is not None and len(out) >= limit:
                break
            if line.strip():
                out.append(_parse(json.loads(line)))
    return out


def _parse(d: dict) -> TraceRequest:
    return TraceRequest(int(d["timestamp"]), int(d["input_length"]), int(d["output_length"]),
                        tuple(int(h) for h in d["hash_ids"]))


def block_tokens(hash_id: int, block_tokens: int = TRACE_BLOCK_TOKENS) -> list[int]:
    """The fixed token block of one hash id: a seeded PCG64 draw, so it is the same in every process
    and two ids collide only with negligible probability."""
    return np.random.default_rng(hash_id).integers(0, VOCAB, block_tokens).tolist()


class TraceHasher:
    """Turns a request's hash ids into kvd block hashes, memoized per (parent, id): the trace has
    ~183k unique blocks among ~289k block references."""

    def __init__(self, block_tokens: int = TRACE_BLOCK_TOKENS):
        self.block_tokens = block_tokens
        self.root = namespace_root("mooncake-trace", "synthetic", "none", "trace", block_tokens)
        self._memo: dict[tuple[BlockHash, int], BlockHash] = {}

    def chain(self, hash_ids: tuple[int, ...]) -> list[BlockHash]:
        out: list[BlockHash] = []
        parent = self.root
        for hid in hash_ids:
            key = (parent, hid)
            child = self._memo.get(key)
            if child is None:
                child = self._memo[key] = block_hash(parent, block_tokens(hid, self.block_tokens))
            out.append(child)
            parent = child
        return out


def unique_blocks(trace: list[TraceRequest]) -> int:
    return len({h for r in trace for h in r.hash_ids})


def ideal_token_hit_rate(trace: list[TraceRequest], block_tokens: int = TRACE_BLOCK_TOKENS) -> float:
    """Infinite cache: every block seen before hits (longest seen prefix, capped at input_length)."""
    seen: set[int] = set()
    hit = total = 0
    for r in trace:
        k = next((i for i, h in enumerate(r.hash_ids) if h not in seen), len(r.hash_ids))
        hit += min(k * block_tokens, r.input_length)
        total += r.input_length
        seen.update(r.hash_ids)
    return hit / total if total else 0.0
