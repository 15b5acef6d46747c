"""The DRAM tier of one cache group: POSIX shared memory, pinned for DMA when CUDA exists.

Why a /dev/shm file rather than ``pin_memory=True``: other processes can map it, and a /dev/shm
mapping registered with cudaHostRegister copies at the same 55 GB/s as pinned memory (DESIGN.md §7).
If registration fails (pinned-memory exhaustion) the tier still works, unpinned. If the memory itself
cannot be had (/dev/shm too small), construction raises OSError and the group runs without DRAM.
"""
from __future__ import annotations

import logging
from pathlib import Path

import torch

from kvd.tiers.base import MemoryPool, shm_dir, shm_tensor
from kvd.tiers.gpu import use_cuda
from kvd.types import Tier

log = logging.getLogger(__name__)


class DramPool(MemoryPool):
    tier = Tier.DRAM

    def __init__(self, tag: str, blocks: int, block_bytes: int, device: str, run_dir: Path) -> None:
        path = shm_dir(run_dir) / f"{tag}-dram.pool"
        super().__init__(Tier.DRAM, shm_tensor(path, blocks, block_bytes, reserve=True), path)
        self.pinned = use_cuda(device) and self._pin()

    def _pin(self) -> bool:
        t = self.tensor
        rc = torch.cuda.cudart().cudaHostRegister(t.data_ptr(), t.numel(), 0)
        if int(rc) != 0:
            log.warning("cudaHostRegister failed (%s): DRAM tier unpinned, copies will be slower", rc)
            return False
        return True

    def close(self) -> None:
        if self.pinned:
            torch.cuda.cudart().cudaHostUnregister(self.tensor.data_ptr())
        super().close()
