"""Storage tiers: GPU pool, DRAM (shared memory), NVMe slab files; one BlockPool interface."""
import torch

from kvd.tiers.base import BlockMeta, BlockPool, MemoryPool, copy_runs

__all__ = ["BlockMeta", "BlockPool", "MemoryPool", "move_many"]


def move_many(src: BlockPool, src_slots: list[int], dst: BlockPool, dst_slots: list[int], metas: list[BlockMeta]) -> None:
    """Copy a batch of whole blocks one tier down (the cleaner's demotions): memory to memory as runs of
    adjacent slots, memory to NVMe as one batched write (one index append for the batch)."""
    if not isinstance(src, MemoryPool):
        raise ValueError("demotions read from a memory pool")
    if isinstance(dst, MemoryPool):
        copy_runs(dst.tensor, dst_slots, src.tensor, src_slots)
    elif src.tensor.is_cuda:   # one gather and one device-to-host transfer for the batch
        rows = src.tensor[torch.tensor(src_slots, device=src.tensor.device)].cpu()  # [n, block_bytes]
        dst.write_many(dst_slots, list(rows), metas)  # type: ignore[attr-defined]
    else:
        dst.write_many(dst_slots, [src.view(s) for s in src_slots], metas)  # type: ignore[attr-defined]
