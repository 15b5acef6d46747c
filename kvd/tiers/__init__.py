"""Storage tiers: GPU pool, DRAM (shared memory), NVMe slab files; one BlockPool interface."""
from kvd.tiers.base import BlockMeta, BlockPool, MemoryPool

__all__ = ["BlockMeta", "BlockPool", "MemoryPool", "move"]


def move(src: BlockPool, src_slot: int, dst: BlockPool, dst_slot: int, meta: BlockMeta) -> None:
    """Copy one whole block between tiers; at least one side is a memory pool."""
    if isinstance(dst, MemoryPool):
        src.read_into(src_slot, dst.view(dst_slot))
    elif isinstance(src, MemoryPool):
        dst.write_from(dst_slot, src.view(src_slot), meta)
    else:
        raise ValueError("NVMe to NVMe moves are not supported")
