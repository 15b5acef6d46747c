"""Test helpers: KV pools laid out as the engine lays them out, and ragged batches over them."""
from __future__ import annotations

import torch


def make_pool(num_blocks: int, num_layers: int, block_size: int, num_kv_heads: int, head_dim: int,
              dtype: torch.dtype) -> torch.Tensor:
    """A random pool [N, L, 2, bs, Hkv, D]: per-layer K/V views of it are strided in N."""
    return torch.randn(num_blocks, num_layers, 2, block_size, num_kv_heads, head_dim).to(dtype)


def random_block_tables(seq_lens: list[int], block_size: int, num_blocks: int) -> torch.Tensor:
    """[B, max_blocks] int32 of distinct, permuted block ids; unused entries are -1 so that a
    kernel reading past a sequence's blocks would fetch garbage and fail the comparison."""
    need = [-(-n // block_size) for n in seq_lens]
    ids = torch.randperm(num_blocks)[: sum(need)]
    table = torch.full((len(seq_lens), max(need) + 1), -1, dtype=torch.int32)
    start = 0
    for b, n in enumerate(need):
        table[b, :n] = ids[start:start + n].int()
        start += n
    return table


def cu_lens(q_lens: list[int]) -> torch.Tensor:
    """[B+1] int32 prefix sums."""
    return torch.tensor([0] + torch.tensor(q_lens).cumsum(0).tolist(), dtype=torch.int32)
