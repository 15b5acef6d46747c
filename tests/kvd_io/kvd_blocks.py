"""Block contents that identify their hash, so a block served under the wrong hash is caught byte
for byte, and linked test chains."""
from __future__ import annotations

import hashlib

from client.kvd_client import KvdClient

BLOCK_BYTES = 256


def pattern(h: bytes, nbytes: int) -> bytes:
    """The distinct content written for hash ``h``."""
    return hashlib.shake_256(b"kvd-test" + h).digest(nbytes)


def chain_of(seed: int, n: int) -> list[bytes]:
    """n linked 16-byte hashes; block i's parent is block i-1 (None for the first)."""
    out, parent = [], b""
    for i in range(n):
        parent = hashlib.blake2b(parent + f"{seed}/{i}".encode(), digest_size=16).digest()
        out.append(parent)
    return out


def commit_chain(client: KvdClient, pool, chain: list[bytes]) -> None:
    lease, blocks = client.allocate("full", len(chain))
    for b, h in zip(blocks, chain):
        pool[b] = _tensor(pattern(h, BLOCK_BYTES))
    client.commit(lease, list(zip(blocks, chain, [None, *chain[:-1]])))
    client.release(lease)


def _tensor(data: bytes):
    import torch

    return torch.frombuffer(bytearray(data), dtype=torch.uint8)


def served_bytes_match(client: KvdClient, pool, chain: list[bytes]) -> int:
    """Look the chain up; every block served must hold its own hash's bytes. Returns hits."""
    hit = client.lookup("full", chain)
    if not hit.ready:
        client.wait_ready(hit.lease, 10)
    for slot, h in zip(hit.hits, chain):
        assert bytes(pool[slot].numpy()) == pattern(h, BLOCK_BYTES), "a block served under the wrong hash"
    if hit.lease:
        client.release(hit.lease)
    return hit.num_hits
