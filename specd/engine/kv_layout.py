"""How model KV maps onto kvd's byte blocks.

One block holds every layer of ``block_size`` tokens contiguously, ``[L, 2, bs, Hkv, D]``, so a tier
move copies one object per block (0.5-4 MB on real models) instead of L small tensors.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class KVLayout:
    num_layers: int
    block_size: int
    num_kv_heads: int
    head_dim: int
    dtype: torch.dtype

    @property
    def block_bytes(self) -> int:
        elem = torch.empty((), dtype=self.dtype).element_size()
        return self.num_layers * 2 * self.block_size * self.num_kv_heads * self.head_dim * elem

    def describe(self) -> str:
        """Part of the cache namespace: blocks with another layout must never match."""
        return f"L{self.num_layers}-bs{self.block_size}-h{self.num_kv_heads}-d{self.head_dim}-{str(self.dtype).removeprefix('torch.')}"

    def view(self, pool: torch.Tensor) -> torch.Tensor:
        """pool: [N, block_bytes] uint8 -> [N, L, 2, bs, Hkv, D] in the model dtype (no copy)."""
        n = pool.shape[0]
        return pool.view(self.dtype).view(n, self.num_layers, 2, self.block_size, self.num_kv_heads, self.head_dim)
