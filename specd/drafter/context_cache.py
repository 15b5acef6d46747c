"""DraftContext: one request's drafter context K/V, kept across draft steps and grown in place.

Why: a feature drafter attends over keys/values projected from the target features of every
computed position. Recomputing them from all features at every draft step (and keeping all features
around to do so) makes each step O(context): on a 10k-token prompt with 32 requests that is ~0.5 GB of
feature copies per step. The context K/V of a position never change once its token is accepted, so
they are projected once (``absorb``) and appended here; capacity doubles, so appends are amortised
O(1). Block (draft) K/V are never stored: DeepSpec's "crop the draft cache after each block".

``offset`` is the absolute position of the context's position 0. It is 0 when the context holds every
position from the start (cold, or restored from kvd's draft group: specd/engine/draft_cache.py); after a
target prefix hit without a draft hit the context starts at the first computed token, shifted to 0, and
``offset`` says how much is missing. Only an ``offset == 0`` context may be published: a shifted one
holds K/V rotated at the wrong positions.
"""
from __future__ import annotations

from typing import Sequence

import torch
from torch import Tensor

KV = tuple[Tensor, Tensor]

MIN_CAPACITY = 64


class DraftContext:
    def __init__(self, layers: int, kv_heads: int, head_dim: int, dtype: torch.dtype, device: torch.device) -> None:
        self.n = 0                       # positions 0..n-1 are held
        self.offset = 0                  # absolute position of position 0 (> 0: a gapped, shifted context)
        shape = (MIN_CAPACITY, kv_heads, head_dim)
        self._k = [torch.empty(shape, dtype=dtype, device=device) for _ in range(layers)]   # [capacity, Hkv, D]
        self._v = [torch.empty(shape, dtype=dtype, device=device) for _ in range(layers)]

    def append(self, kvs: Sequence[KV]) -> None:
        """kvs: per layer (k, v), each [m, Hkv, D], for positions n..n+m-1 (``append_many`` of one)."""
        append_many([self], [kvs])

    def _reserve(self, m: int) -> None:
        """Room for m more positions: capacity doubles (at least to n + m), keeping what is held."""
        if self.n + m > self._k[0].shape[0]:
            cap = max(2 * self._k[0].shape[0], self.n + m)
            self._k = [_grow(t, cap, self.n) for t in self._k]
            self._v = [_grow(t, cap, self.n) for t in self._v]

    def layer(self, i: int) -> KV:
        return self._k[i][: self.n], self._v[i][: self.n]

    @property
    def num_layers(self) -> int:
        return len(self._k)

    def position_shape(self) -> tuple[int, int]:
        """(Hkv, D): the shape of one position's key (or value) in one layer."""
        return tuple(self._k[0].shape[1:])

    @property
    def dtype(self) -> torch.dtype:
        return self._k[0].dtype


def append_many(contexts: Sequence[DraftContext], kvs: Sequence[Sequence[KV]]) -> None:
    """Append ``kvs[i]`` (per layer (k, v), each [m_i, Hkv, D]) to ``contexts[i]`` for every i, the copies of
    all contexts and layers in one foreach copy.

    Why: a slice assignment per layer for k and for v (``append`` until session 16) is two copy launches
    per layer and request; a drafting round of 32 requests appended with 64 launches per layer
    (``BlockDrafter.absorb_many``), ~7 µs of host time each on the H200. The same copies into the same
    slices (casting as ``copy_`` does), so the contexts hold exactly what the assignments wrote
    (tests/drafter/test_context_cache.py)."""
    dsts, srcs = [], []
    for c, per_layer in zip(contexts, kvs):
        m = per_layer[0][0].shape[0]
        c._reserve(m)
        for layer, (k, v) in enumerate(per_layer):
            dsts += [c._k[layer][c.n:c.n + m], c._v[layer][c.n:c.n + m]]
            srcs += [k, v]
        c.n += m
    if dsts:
        torch._foreach_copy_(dsts, srcs)


def _grow(t: Tensor, cap: int, used: int) -> Tensor:
    out = t.new_empty((cap, *t.shape[1:]))
    out[:used] = t[:used]
    return out


def padded_layer(contexts: Sequence[DraftContext], layer: int) -> KV:
    """One layer's context K/V of B requests, right-padded: k, v [B, S_max, Hkv, D]."""
    pad = torch.nn.utils.rnn.pad_sequence
    ks, vs = zip(*(c.layer(layer) for c in contexts))
    return pad(list(ks), batch_first=True), pad(list(vs), batch_first=True)


def copy_into_rows(contexts: Sequence[DraftContext], dst: Sequence[KV], row: int) -> None:
    """Write context i's K/V at positions i·row .. i·row + n_i - 1 of flat static buffers, every layer in
    one foreach copy: row i of a [Bp, row, Hkv, D] view.

    dst: per layer (k, v), each [>= Bp·row, Hkv, D]; row >= every n_i. A row's positions >= n_i keep what
    they held (a reader masks them), so a step copies the contexts, never clears. On CUDA
    ``_foreach_copy_`` batches the copies into a few kernel launches instead of one per request and layer;
    slicing the flat buffer costs one view op per copy."""
    dsts, srcs = [], []
    for layer, (k, v) in enumerate(dst):
        for i, c in enumerate(contexts):
            if c.n:
                dsts += [k[i * row: i * row + c.n], v[i * row: i * row + c.n]]
                srcs += c.layer(layer)
    if dsts:
        torch._foreach_copy_(dsts, srcs)
