"""ContiguousKV: the simplest AttentionBackend, one growing K/V tensor per (sequence, layer).

Used by the tests, the transformers comparison and as a CPU fallback. It supports several sequences
in one flat step (a ragged batch) so tests can check that batching does not change any logit; the
engine's paged backend (kvspec_kernels/paged_attention.py) must reproduce exactly what this one computes.

Sliding-window layers (`windows[layer] = W`) mask keys older than W positions; the cache still keeps
every key, because this backend is for correctness, not memory.

Usage per step:
    kv = ContiguousKV.for_model(model.config)        # or ContiguousKV(num_layers) for full attention
    positions = kv.begin([(seq_a, 5), (seq_b, 1)])   # tokens of seq_a first, then seq_b, in the flat [T]
    out = model(input_ids, positions, kv)
"""
from __future__ import annotations

from typing import Hashable, Sequence

import torch
import torch.nn.functional as F
from torch import Tensor

from specd.models.config import ModelConfig


class ContiguousKV:
    """Growing per-sequence caches. Only `begin`, `__call__` and `free` mutate it (one caller, no threads)."""

    def __init__(self, num_layers: int, windows: Sequence[int | None] | None = None):
        self.num_layers = num_layers
        self.windows = tuple(windows) if windows is not None else (None,) * num_layers  # per layer: W or None
        if len(self.windows) != num_layers:
            raise ValueError(f"{len(self.windows)} windows for {num_layers} layers")
        self._k: dict[Hashable, list[Tensor | None]] = {}
        self._v: dict[Hashable, list[Tensor | None]] = {}
        self._segments: list[tuple[Hashable, int]] = []

    @classmethod
    def for_model(cls, config: ModelConfig) -> "ContiguousKV":
        """A backend with the model's per-layer windows (what DecoderModel checks for)."""
        return cls(config.num_layers, config.layer_windows)

    def seq_len(self, seq: Hashable) -> int:
        """Tokens cached for `seq` (as of the last layer written)."""
        k = self._k.get(seq, [None])[-1]
        return 0 if k is None else k.shape[0]

    def begin(self, segments: Sequence[tuple[Hashable, int]], device: str | torch.device = "cpu") -> Tensor:
        """Declare the step's layout (sequence id, new tokens) in flat order; returns positions [T] int64.

        New tokens of a sequence continue right after its cached ones.
        """
        if len({seq for seq, _ in segments}) != len(segments):
            raise ValueError("a sequence may appear once per step")
        self._segments = list(segments)
        for seq, _ in segments:
            self._k.setdefault(seq, [None] * self.num_layers)
            self._v.setdefault(seq, [None] * self.num_layers)
        return torch.cat([torch.arange(self.seq_len(s), self.seq_len(s) + n, device=device) for s, n in segments])

    def free(self, seq: Hashable) -> None:
        self._k.pop(seq, None)
        self._v.pop(seq, None)

    def __call__(self, layer: int, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        """q: [T, Hq, D]; k, v: [T, Hkv, D] (rotated). Returns [T, Hq, D]; appends k, v to each sequence."""
        if sum(n for _, n in self._segments) != q.shape[0]:
            raise ValueError(f"step declared {sum(n for _, n in self._segments)} tokens, got {q.shape[0]}")
        outs, start = [], 0
        for seq, n in self._segments:
            keys = self._append(self._k[seq], layer, k[start:start + n])
            vals = self._append(self._v[seq], layer, v[start:start + n])
            outs.append(causal_attention(q[start:start + n], keys, vals, self.windows[layer]))
            start += n
        return torch.cat(outs)

    @staticmethod
    def _append(cache: list[Tensor | None], layer: int, new: Tensor) -> Tensor:
        old = cache[layer]
        cache[layer] = new.clone() if old is None else torch.cat([old, new])
        return cache[layer]


def causal_attention(q: Tensor, k: Tensor, v: Tensor, window: int | None = None) -> Tensor:
    """q: [n, Hq, D] are the last n of the L positions in k, v: [L, Hkv, D]. Returns [n, Hq, D].

    Query i sits at position p = L - n + i and sees keys 0..p (bottom-right aligned causal mask), or
    only p - window < j <= p with a sliding window (the kernels' and transformers' convention).
    """
    n, big_l = q.shape[0], k.shape[0]
    mask = torch.ones(n, big_l, dtype=torch.bool, device=q.device).tril(diagonal=big_l - n)
    if window is not None:
        mask &= ~torch.ones_like(mask).tril(diagonal=big_l - n - window)
    out = F.scaled_dot_product_attention(
        q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), attn_mask=mask, enable_gqa=True
    )                                                                     # [Hq, n, D]
    return out.transpose(0, 1)
