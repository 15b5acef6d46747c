"""How model KV maps onto kvd's byte blocks, and how layers split into cache groups.

One block holds every layer of a group for ``block_size`` tokens contiguously, ``[L_g, 2, bs, Hkv, D]``,
so a tier move copies one object per block (0.5-4 MB on real models) instead of L small tensors.
A full-attention model has one group, ``full``, holding all layers (the layout every served model
uses today). A model with sliding-window layers gets two: ``full`` (its full-attention layers) and
``swa`` (its sliding layers), each a kvd cache group of its own, so the sliding layers' blocks can be
dropped once no servable prefix end needs them (kvd/hybrid_hits.py, docs/design/kvd.md).
"""
from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from kvd.hybrid_hits import tail_blocks


@dataclass(frozen=True)
class KVLayout:
    num_layers: int
    block_size: int
    num_kv_heads: int
    head_dim: int
    dtype: torch.dtype
    # one sliding window (or None) per layer; empty: every layer attends fully (one group)
    windows: tuple[int | None, ...] = ()

    @property
    def block_bytes(self) -> int:
        elem = torch.empty((), dtype=self.dtype).element_size()
        return self.num_layers * 2 * self.block_size * self.num_kv_heads * self.head_dim * elem

    @property
    def hybrid(self) -> bool:
        return any(w is not None for w in self.windows)

    def describe(self) -> str:
        """Part of the cache namespace: blocks with another layout (or group split) must never match."""
        base = f"L{self.num_layers}-bs{self.block_size}-h{self.num_kv_heads}-d{self.head_dim}-{str(self.dtype).removeprefix('torch.')}"
        if not self.hybrid:
            return base
        return base + "-" + "-".join(f"{g.name}{list(g.layers)}k{g.tail_blocks}" for g in self.groups())

    def groups(self) -> list["GroupLayout"]:
        """The cache groups, primary first: ``full`` (full-attention layers) then ``swa`` (sliding layers;
        one group with the widest window, so its tail covers every sliding layer)."""
        windows = self.windows or (None,) * self.num_layers
        full = tuple(i for i, w in enumerate(windows) if w is None)
        swa = tuple(i for i, w in enumerate(windows) if w is not None)
        out = []
        if full:
            out.append(GroupLayout("full", full, None, replace(self, num_layers=len(full), windows=()), None))
        if swa:
            w = max(windows[i] for i in swa)
            out.append(GroupLayout("swa", swa, tail_blocks(w, self.block_size),
                                   replace(self, num_layers=len(swa), windows=()), w))
        return out

    def view(self, pool: torch.Tensor) -> torch.Tensor:
        """pool: [N, block_bytes] uint8 -> [N, L, 2, bs, Hkv, D] in the model dtype (no copy)."""
        n = pool.shape[0]
        return pool.view(self.dtype).view(n, self.num_layers, 2, self.block_size, self.num_kv_heads, self.head_dim)


@dataclass(frozen=True)
class GroupLayout:
    """One cache group: which model layers it holds (in order), its kvd tail rule, its block layout,
    and the widest sliding window of its layers (None: full attention)."""

    name: str
    layers: tuple[int, ...]
    tail_blocks: int | None
    layout: KVLayout
    window: int | None
