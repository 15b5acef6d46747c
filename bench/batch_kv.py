"""BatchKV: the target's K/V of many sequences in padded tensors, with a per-row crop.

Why not ContiguousKV: it runs one attention call per sequence and layer and grows its caches with
`torch.cat`, so a step over 128 sequences of Qwen-0.5B costs ~3,000 small launches of host time. Here a
decode or verify step (a few new tokens per row) is one scatter and one masked attention call per
layer, whatever the batch; only long prefills fall back to one call per row (once per prompt).

Rows are integer slots in [0, rows). Each row's keys live at positions [0, length) of its slot;
`crop(row, n)` forgets everything past n (speculative verification keeps only the accepted prefix),
`free(row)` empties the slot. Full attention only (no sliding windows: DecoderModel refuses a backend
without `windows` for such a model).

    kv = BatchKV.for_model(model.config, rows=B, capacity=L, device=dev)
    positions = kv.begin([(0, 5), (3, 1)])           # row 0 gets 5 tokens, row 3 one, in flat order
    out = model(ids, positions, kv)
"""
from __future__ import annotations

from typing import Sequence

import torch
import torch.nn.functional as F
from torch import Tensor

from specd.models.config import ModelConfig
from specd.models.contiguous import causal_attention

# Steps whose longest row adds more tokens than this run attention row by row (prefill): a padded
# [B, n_max, L] score tensor of a long prefill would not fit; short steps are batched.
BATCHED_QUERY_MAX = 64
# Prompt tokens per prefill forward: bounds the activations (and captured features) of long prompts.
PREFILL_TOKENS = 16384


class BatchKVError(ValueError):
    """A step that does not fit the cache (unknown row, over capacity, token count mismatch)."""


class BatchKV:
    def __init__(self, num_layers: int, rows: int, capacity: int, num_kv_heads: int, head_dim: int,
                 dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu"):
        shape = (rows, capacity, num_kv_heads, head_dim)
        self.k = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.v = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.capacity = capacity
        self.lengths = [0] * rows            # host-side, so no step reads a device tensor back
        self.device = torch.device(device)
        self._step: _Step | None = None

    @classmethod
    def for_model(cls, config: ModelConfig, rows: int, capacity: int, dtype: torch.dtype = torch.float32,
                  device: str | torch.device = "cpu") -> "BatchKV":
        return cls(config.num_layers, rows, capacity, config.num_kv_heads, config.head_dim, dtype, device)

    def begin(self, segments: Sequence[tuple[int, int]], device: str | torch.device | None = None) -> Tensor:
        """Declare the step: (row, new tokens) in flat order. Returns positions [T] int64 on the cache's device."""
        rows = [r for r, _ in segments]
        if len(set(rows)) != len(rows):
            raise BatchKVError("a row may appear once per step")
        starts = [self.lengths[r] for r in rows]
        sizes = [n for _, n in segments]
        for r, s, n in zip(rows, starts, sizes):
            if s + n > self.capacity:
                raise BatchKVError(f"row {r}: {s} + {n} tokens exceed the capacity {self.capacity}")
            self.lengths[r] = s + n
        self._step = _Step(rows, starts, sizes, self.device)
        return self._step.pos

    def crop(self, row: int, length: int) -> None:
        self.lengths[row] = min(self.lengths[row], length)

    def free(self, row: int) -> None:
        self.lengths[row] = 0

    def __call__(self, layer: int, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        """q: [T, Hq, D]; k, v: [T, Hkv, D] (rotated) -> [T, Hq, D]; writes k, v into the rows' slots."""
        st = self._step
        if st is None or st.total != q.shape[0]:
            raise BatchKVError(f"step declared {st and st.total} tokens, got {q.shape[0]}")
        self.k[layer][st.row, st.pos] = k.to(self.k[layer].dtype)
        self.v[layer][st.row, st.pos] = v.to(self.v[layer].dtype)
        if st.n_max <= BATCHED_QUERY_MAX:
            return self._batched(layer, q, st)
        outs = [causal_attention(q[o:o + n], self.k[layer][r, :s + n], self.v[layer][r, :s + n])
                for r, s, n, o in zip(st.rows, st.starts, st.sizes, st.offsets)]
        return torch.cat(outs)

    def _batched(self, layer: int, q: Tensor, st: "_Step") -> Tensor:
        """One masked attention over the step's rows: queries padded to [b, n_max], keys to [b, L]."""
        b, hq, d = len(st.rows), q.shape[1], q.shape[2]
        qp = q.new_zeros(b, st.n_max, hq, d)
        qp[st.slot, st.col] = q
        keys = self.k[layer][st.row_index, :st.key_len]                        # [b, L, Hkv, D]
        vals = self.v[layer][st.row_index, :st.key_len]
        out = F.scaled_dot_product_attention(qp.transpose(1, 2), keys.transpose(1, 2), vals.transpose(1, 2),
                                             attn_mask=st.mask[:, None], enable_gqa=True)   # [b, Hq, n_max, D]
        return out.transpose(1, 2)[st.slot, st.col]


def token_chunks(sizes: Sequence[int], budget: int = PREFILL_TOKENS) -> list[list[int]]:
    """Consecutive indices grouped so each group's sizes sum to at most `budget` (a larger item alone)."""
    chunks: list[list[int]] = []
    total = budget + 1
    for i, n in enumerate(sizes):
        if total + n > budget:
            chunks.append([])
            total = 0
        chunks[-1].append(i)
        total += n
    return chunks


class _Step:
    """Index tensors of one step, built once in `begin` and shared by every layer."""

    def __init__(self, rows: list[int], starts: list[int], sizes: list[int], device: torch.device):
        self.rows, self.starts, self.sizes = rows, starts, sizes
        self.offsets = [0]
        for n in sizes[:-1]:
            self.offsets.append(self.offsets[-1] + n)
        self.total = sum(sizes)
        self.n_max = max(sizes, default=0)
        self.key_len = max((s + n for s, n in zip(starts, sizes)), default=0)
        slot = torch.repeat_interleave(torch.arange(len(rows)), torch.tensor(sizes, dtype=torch.int64))
        col = torch.arange(self.total) - torch.tensor(self.offsets, dtype=torch.int64)[slot]
        start = torch.tensor(starts, dtype=torch.int64)
        self.slot, self.col = slot.to(device), col.to(device)
        self.row_index = torch.tensor(rows, dtype=torch.int64).to(device)
        self.row = self.row_index[self.slot]                                      # [T] cache row per token
        self.pos = (start[slot] + col).to(device)                                # [T] position per token
        if self.n_max <= BATCHED_QUERY_MAX:
            # query (slot, c) sits at start + c and sees keys 0..start + c; padded queries see key 0 only
            qpos = start[:, None] + torch.arange(self.n_max)[None]                   # [b, n_max]
            qpos = torch.where(torch.arange(self.n_max)[None] < torch.tensor(sizes)[:, None], qpos, 0)
            self.mask = (torch.arange(self.key_len)[None, None] <= qpos[..., None]).to(device)
