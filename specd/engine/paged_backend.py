"""The attention backend the engine hands to the model: append this step's K/V into pool slots,
then run paged attention over each sequence's block table.

The metadata for a step is built once (``set_step``) and read by every layer.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch

import kvspec_kernels as kernels


@dataclass
class StepMetadata:
    slot_mapping: torch.Tensor   # [T] int64: pool slot (block*bs + offset) of each new token
    block_tables: torch.Tensor   # [B, max_blocks] int32
    cu_q_lens: torch.Tensor      # [B+1] int32
    seq_lens: torch.Tensor       # [B] int32, KV length including this step's tokens
    max_q_len: int


class PagedAttentionBackend:
    def __init__(self, pool_view: torch.Tensor, scale: float, windows: Sequence[int | None] | None = None):
        # pool_view: [N, L, 2, bs, Hkv, D]; windows: one sliding window (or None = full) per layer
        self.pool_view = pool_view
        self.scale = scale
        self.windows = tuple(windows) if windows is not None else (None,) * pool_view.shape[1]
        self.meta: StepMetadata | None = None

    def set_step(self, meta: StepMetadata) -> None:
        self.meta = meta

    def __call__(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        # q: [T, Hq, D]; k, v: [T, Hkv, D]
        meta = self.meta
        k_pool = self.pool_view[:, layer, 0]
        v_pool = self.pool_view[:, layer, 1]
        kernels.append_kv(k, v, k_pool, v_pool, meta.slot_mapping)
        return kernels.paged_attention(
            q, k_pool, v_pool, meta.block_tables, meta.cu_q_lens, meta.seq_lens, self.scale,
            sliding_window=self.windows[layer], max_q_len=meta.max_q_len,
        )
