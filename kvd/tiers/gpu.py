"""The GPU pool of one cache group: the blocks attention reads.

On CUDA it is device memory handed out through a CUDA IPC handle (``storage._share_cuda_()``; best
effort, untested without a GPU). Otherwise it is a shared-memory CPU tensor in /dev/shm that specd
maps from ``path``: the same code path, so everything runs and is tested on the CPU.
"""
from __future__ import annotations

from pathlib import Path

import torch

from kvd.tiers.base import MemoryPool, shm_dir, shm_tensor
from kvd.types import Tier


def use_cuda(device: str) -> bool:
    return device == "cuda" or (device == "auto" and torch.cuda.is_available())


class GpuPool(MemoryPool):
    tier = Tier.GPU

    def __init__(self, tag: str, blocks: int, block_bytes: int, device: str, run_dir: Path) -> None:
        self.ipc_handle: tuple | None = None
        if use_cuda(device):
            tensor = torch.zeros(blocks, block_bytes, dtype=torch.uint8, device="cuda")
            super().__init__(Tier.GPU, tensor, None)
            self.ipc_handle = tuple(tensor.untyped_storage()._share_cuda_())
        else:
            path = shm_dir(run_dir) / f"{tag}-gpu.pool"
            super().__init__(Tier.GPU, shm_tensor(path, blocks, block_bytes), path)

    @property
    def kind(self) -> str:
        return "cuda" if self.tensor.is_cuda else "shm"
