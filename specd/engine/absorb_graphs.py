"""CUDA graphs for a block drafter's context projection: new fused features -> their context K/V.

Why: every drafting step first moves the requests' newly accepted features into their drafter contexts
(``BlockDrafter.absorb_many``: RoPE tables, then per draft layer the k projection, its norm, the rotation and
the v projection). Eagerly that is a dozen small launches plus a host-to-device copy of the positions, each
~10-20 µs of host time on the H200, in a drafting step that already cost ~1.9 plain steps (session 29, run
CK, extraction c = 1: 3.38 against 1.77 ms). The block forward and the sampling round were already replayed
from graphs (block_graphs.py, draft_graphs.py); this was the round's last eager piece before the forward.

A graph is captured per token bucket T (``ABSORB_BUCKETS`` up to the largest that fits ``max_tokens``):
static inputs x [T, d] and positions [T], static outputs per layer k, v [T, Hkv, D]. Padding is inert: the
projection is row-wise (norm, linear, RoPE per position), so a padded row (a position and features left from
an earlier call, or the warm-up's zeros: finite) changes no real row, and only the first n rows are read
back. A batch of more new tokens than the largest bucket (a long prompt's first draft) runs the eager
reference, ``BlockDrafter.context_kv``.

The outputs are views of the static buffers, valid until the next call: ``absorb_many`` copies them into the
contexts (``context_cache.append_many``) at once.
"""
from __future__ import annotations

from typing import Sequence

import torch
from torch import Tensor

from specd.engine.keyed_graphs import KeyedGraphs

ABSORB_BUCKETS = (8, 16, 32, 64, 128, 256, 512, 1024, 2048)

KV = tuple[Tensor, Tensor]


def absorb_bucket(n: int, buckets: Sequence[int]) -> int | None:
    """The smallest bucket holding n new tokens, or None (the eager reference)."""
    return next((b for b in buckets if b >= n), None)


class AbsorbGraphs(KeyedGraphs):
    """Static inputs and outputs of the context projection, and its graphs per token bucket.

    ``max_tokens``: the most new tokens one call may bring (buckets above it are not kept).
    ``replay_eagerly``: run the same static computation without a CUDA graph (the CPU tests)."""

    def __init__(self, drafter, max_tokens: int, device: torch.device, replay_eagerly: bool = False, pool=None):
        c = drafter.config.backbone()
        top = absorb_bucket(max_tokens, ABSORB_BUCKETS) or ABSORB_BUCKETS[-1]
        self.buckets = tuple(b for b in ABSORB_BUCKETS if b <= top)
        t, dtype, layers = self.buckets[-1], drafter.fc.weight.dtype, len(drafter.layers)
        self._x = torch.zeros(t, drafter.config.hidden_size, dtype=dtype, device=device)
        self._pos = torch.zeros(t, dtype=torch.int64, device=device)
        self._kv = torch.zeros(layers, 2, t, c.num_kv_heads, c.head_dim, dtype=dtype, device=device)
        super().__init__(len(self.buckets), "context projection", replay_eagerly,
                         pool if pool is not None or replay_eagerly else torch.cuda.graph_pool_handle())
        self.eager_calls = 0          # calls with more new tokens than the largest bucket

    def warm_keys(self) -> list[int]:
        return sorted(self.buckets, reverse=True)

    def _inert(self, key: int) -> None:
        self._x[:key].zero_()
        self._pos[:key].zero_()

    def _body(self, drafter, key: int) -> None:
        kvs = drafter.context_kv(self._x[:key][None], self._pos[:key][None])
        for layer, (k, v) in enumerate(kvs):
            self._kv[layer, 0, :key].copy_(k[0])
            self._kv[layer, 1, :key].copy_(v[0])

    @torch.inference_mode()
    def run(self, drafter, feats: Sequence[Tensor], positions: Sequence[int]) -> list[KV] | None:
        """Per layer (k, v) [1, n, Hkv, D] of the concatenated ``feats`` (n rows in all) at ``positions``
        (n ints), as ``drafter.context_kv`` gives them; None when no bucket holds n (run the reference)."""
        n = len(positions)
        key = absorb_bucket(n, self.buckets)
        if not self.can_run(key):
            self.eager_calls += 1
            return None
        # a blocking copy from pageable memory, as the eager path's: two calls may come in one step (a rest's
        # absorb, then the drafting requests' proposal) with no sync between, and a pinned buffer reused by
        # the second could be overwritten before the first's asynchronous copy ran. Rows n..key-1 keep
        # earlier positions (valid ones: their rows are never read)
        self._pos[:n].copy_(torch.tensor(positions, dtype=torch.int64))
        if len(feats) == 1 or feats[0].dtype != self._x.dtype:
            self._x[:n].copy_(feats[0] if len(feats) == 1 else torch.cat(list(feats)))
        else:
            torch.cat(list(feats), out=self._x[:n])
        # rows n..key-1 keep earlier calls' features: finite, and no real row reads them (row-wise)
        self.replay(drafter, key)
        return [(self._kv[layer, 0, :n][None], self._kv[layer, 1, :n][None]) for layer in range(self._kv.shape[0])]
