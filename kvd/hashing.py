"""The block hash chain, defined once.

Why blake2b over a canonical msgpack encoding: it is deterministic across processes and machines
(Python's ``hash()`` changes with PYTHONHASHSEED and gives 0% hits across processes), fast in the
standard library, and 16 bytes keep collisions out of reach for any realistic cache.
"""
from __future__ import annotations

import hashlib
from typing import Sequence

import msgpack

from kvd.types import HASH_BYTES, BlockHash


def _h(*parts: object) -> BlockHash:
    payload = msgpack.packb(list(parts), use_bin_type=True)
    return BlockHash(hashlib.blake2b(payload, digest_size=HASH_BYTES).digest())


def namespace_root(
    model_fingerprint: str,
    tokenizer: str,
    dtype: str,
    layout: str,
    block_size: int,
    adapter: str = "",
    salt: str = "",
) -> BlockHash:
    """The root every chain starts from. Blocks are shared only between equal roots, so a
    different model, dtype, layout, block size, adapter or tenant salt never hits."""
    return _h("kvspec-ns-v1", model_fingerprint, tokenizer, dtype, layout, int(block_size), adapter, salt)


def block_hash(parent: BlockHash, tokens: Sequence[int], extra: bytes = b"") -> BlockHash:
    """H(parent, tokens of this block, extra)."""
    return _h(bytes(parent), [int(t) for t in tokens], bytes(extra))


def chain_hashes(
    root: BlockHash, token_ids: Sequence[int], block_size: int, extra: bytes = b""
) -> list[BlockHash]:
    """One hash per *full* block of ``token_ids``; a trailing partial block is not keyed."""
    if block_size <= 0:
        raise ValueError(f"block_size must be positive, got {block_size}")
    out: list[BlockHash] = []
    parent = root
    for start in range(0, len(token_ids) - block_size + 1, block_size):
        parent = block_hash(parent, token_ids[start : start + block_size], extra)
        out.append(parent)
    return out
