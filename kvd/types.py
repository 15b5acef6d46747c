"""Distinct types for distinct ids, so a block id is never passed where a hash is expected."""
from __future__ import annotations

from enum import IntEnum
from typing import NewType

BlockHash = NewType("BlockHash", bytes)
"""16-byte chained content hash of one full block (see kvd.hashing)."""

BlockId = NewType("BlockId", int)
"""A slot in one cache group's GPU pool: 0 <= id < gpu_blocks."""

LeaseId = NewType("LeaseId", int)
"""A lease handed out by kvd; pins its blocks until released or expired."""

HASH_BYTES = 16


class Tier(IntEnum):
    GPU = 0
    DRAM = 1
    NVME = 2


class BlockKind(IntEnum):
    """What a block holds, as hinted by specd; the reuse policy values shared kinds higher."""

    UNKNOWN = 0
    SYSTEM = 1
    TOOL_SCHEMA = 2
    CONVERSATION = 3
