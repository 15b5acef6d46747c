"""CUDA graphs for a block drafter's block forward: [anchor, MASK x (γ-1)] -> final-normed hidden [B, γ, d].

Why: on the H200 the one-layer drafter's eager block forward cost 2.2-2.9 ms at batch 1, 8 and 32 alike,
nearly all host time (119-181 aten calls at B = 1-32, growing with ``pad_sequence``'s per-request copies),
as much as the 0.5B target's whole decode step from a graph (docs/results/speedup.md). Replayed, it is
one launch, plus the fill below.

What runs where, per round of B requests:
- host: anchors and context lengths packed into one pinned buffer, one host-to-device copy;
- one ``_foreach_copy_`` (context_cache.copy_into_rows): every request's context K/V, every layer, into
  row i of static padded buffers [Bp, S, Hkv, D] (a few launches, not one per request and layer);
- the graph (``BlockDrafter.padded_block_hidden`` on the static buffers): token embedding, RoPE, the draft
  layers with attention over [context K/V ; block] under a mask built from the lengths, final norm;
  its output is copied into a static hidden buffer (the draft round's, specd/engine/draft_graphs.py).
The LM head stays eager at the exact batch (DraftGraphs.load): see the exactness note there.

A graph is captured per ``BlockGraphKey``: the batch bucket (draft_graphs.bucket) and a context bucket S
(powers of two from 256 up to the engine's context limit, the limit itself last). Padding is inert: a
padded row has length 0 and anchor 0, so its queries see only its own block; a real row's positions
>= its length are masked. Masked keys must still be finite (0 x NaN is NaN in attention's P·V), so the
buffers start zeroed and only ever receive real K/V.

Memory: the static K/V hold ``capacity`` positions ([L, 2, capacity, Hkv, D]); a key needs Bp·S of them,
and keys past the capacity run the eager reference. At the default 2^18 positions per layer that is
128 MiB for Qwen2.5-0.5B's drafter shape (2 KV heads of 64, bf16) and 1 GiB for a Qwen3-8B shape (8 of
128); graph intermediates (the [Bp, S+γ, Hkv, D] concatenation, attention temporaries) live in the
shared graph pool.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch
from torch import Tensor

from specd.drafter.context_cache import DraftContext, copy_into_rows
from specd.engine.draft_graphs import BATCH_BUCKETS, bucket
from specd.engine.keyed_graphs import KeyedGraphs

MIN_CONTEXT_BUCKET = 256
MAX_CONTEXT_TOKENS = 1 << 18    # static context positions per layer (Bp·S of the largest key); see Memory above
MAX_BLOCK_GRAPHS = 64           # the warm-up needs 45 at 32 sequences and a 32K context (6 x 8 buckets, minus
                                # the 3 past the capacity), 57 at 256 sequences

KV = tuple[Tensor, Tensor]


@dataclass(frozen=True)
class BlockGraphKey:
    batch: int                 # padded row count Bp
    context: int               # padded context length S


def context_buckets(max_len: int) -> list[int]:
    """Powers of two from MIN_CONTEXT_BUCKET below ``max_len``, then ``max_len`` itself."""
    out, s = [], MIN_CONTEXT_BUCKET
    while s < max_len:
        out.append(s)
        s *= 2
    return [*out, max_len]


def block_graph_key(lens: Sequence[int], max_batch: int, buckets: Sequence[int], capacity: int) -> BlockGraphKey | None:
    """The smallest captured shape that holds these contexts, or None (run the eager reference)."""
    b = bucket(len(lens), max_batch)
    s = next((s for s in buckets if s >= max(lens, default=0)), None)
    if b is None or s is None or b * s > capacity:
        return None
    return BlockGraphKey(b, s)


def block_warm_keys(max_batch: int, buckets: Sequence[int], capacity: int) -> list[BlockGraphKey]:
    """Every (batch bucket, context bucket) within the capacity, largest first."""
    batches = sorted({b for b in (*BATCH_BUCKETS, max_batch) if b <= max_batch}, reverse=True)
    keys = [BlockGraphKey(b, s) for b in batches for s in buckets if b * s <= capacity]
    return sorted(keys, key=lambda k: (k.batch * k.context, k.batch), reverse=True)


class BlockGraphs(KeyedGraphs):
    """Static inputs (anchors, lengths, padded context K/V), captured block forwards and their output.

    ``out``: the [Bmax, γ, d] buffer the hidden states land in (the draft round's own, so the round
    reads them without a copy). ``replay_eagerly``: run the same static function without a CUDA graph
    (the CPU tests)."""

    def __init__(self, drafter, max_batch: int, max_len: int, device: torch.device, replay_eagerly: bool = False,
                 pool=None, out: Tensor | None = None, capacity: int = MAX_CONTEXT_TOKENS):
        c = drafter.config.backbone()
        self.max_batch, self.buckets = max_batch, context_buckets(max_len)
        self.capacity = min(capacity, max_batch * self.buckets[-1])
        dtype = drafter.fc.weight.dtype
        self._kv = torch.zeros(len(drafter.layers), 2, self.capacity, c.num_kv_heads, c.head_dim, dtype=dtype,
                               device=device)                          # [L, 2, capacity, Hkv, D]
        self._ints = torch.zeros(2 * max_batch, dtype=torch.int64, device=device)          # anchors, lens
        self._h_ints = torch.zeros(2 * max_batch, dtype=torch.int64, pin_memory=device.type == "cuda")
        shape = (max_batch, drafter.config.gamma, drafter.config.hidden_size)
        self.hidden = out if out is not None else torch.zeros(shape, dtype=dtype, device=device)
        super().__init__(MAX_BLOCK_GRAPHS, "block forward", replay_eagerly,
                         pool if pool is not None or replay_eagerly else torch.cuda.graph_pool_handle())
        self.eager_forwards = 0       # batches no key held (too many rows or too long a context)

    @property
    def memory_bytes(self) -> int:
        """The static context K/V (the graphs' intermediates are in the shared pool, not counted)."""
        return self._kv.numel() * self._kv.element_size()

    def key(self, contexts: Sequence[DraftContext]) -> BlockGraphKey | None:
        return block_graph_key([c.n for c in contexts], self.max_batch, self.buckets, self.capacity)

    def warm_keys(self) -> list[BlockGraphKey]:
        return block_warm_keys(self.max_batch, self.buckets, self.capacity)

    def context(self, key: BlockGraphKey) -> list[KV]:
        """Per layer (k, v) [Bp, S, Hkv, D]: views of the first Bp·S static positions."""
        n, shape = key.batch * key.context, (key.batch, key.context, *self._kv.shape[3:])
        return [(kv[0, :n].view(shape), kv[1, :n].view(shape)) for kv in self._kv]

    # -- inputs ----------------------------------------------------------------------------------------
    def load(self, contexts: Sequence[DraftContext], last_tokens: Sequence[int], key: BlockGraphKey) -> None:
        """Anchors and lengths in one copy (padding rows: 0 and 0), the contexts' K/V in one foreach copy."""
        n, bm, bp, h = len(contexts), self.max_batch, key.batch, self._h_ints
        h[:bp] = 0
        h[bm:bm + bp] = 0
        h[:n] = torch.tensor(list(last_tokens), dtype=torch.int64)
        h[bm:bm + n] = torch.tensor([c.n for c in contexts], dtype=torch.int64)
        self._ints.copy_(h, non_blocking=True)
        copy_into_rows(contexts, [(kv[0], kv[1]) for kv in self._kv], key.context)

    def _inert(self, key: BlockGraphKey) -> None:
        """Warm-up inputs: every row padding (anchor 0, length 0); the K/V buffers are left as they are."""
        self._ints.zero_()

    # -- capture and replay ----------------------------------------------------------------------------
    def _body(self, drafter, key: BlockGraphKey) -> None:
        bp, bm = key.batch, self.max_batch
        hidden = drafter.padded_block_hidden(self._ints[:bp], self._ints[bm:bm + bp], self.context(key))
        self.hidden[:bp].copy_(hidden)

    @torch.inference_mode()
    def run(self, drafter, contexts: Sequence[DraftContext], last_tokens: Sequence[int]) -> Tensor:
        """The block forward of these requests -> hidden [B, γ, d]: a view of the static output, valid
        until the next call. Shapes no graph holds run the eager reference (``draft_hidden``)."""
        key = self.key(contexts)
        if not self.can_run(key):
            self.eager_forwards += 1
            return drafter.draft_hidden(contexts, last_tokens)
        self.load(contexts, last_tokens, key)
        self.replay(drafter, key)
        return self.hidden[: len(contexts)]
