"""PaddedPrefill: the attention backend of a one-shot forward over whole sequences (no cache), one
attention call per layer for the batch.

Why: drafter training runs the target over 8 whole sequences per step (``specd.drafter.train.
target_states``). With ContiguousKV that is one attention call per (sequence, layer) plus its mask and
cache copies: on Qwen-0.5B's 24 layers, ~23k of a step's ~35k aten ops (CPU count, batch 8), and the
H200 step took 185 ms at ~11 µs of host time per op (session 8, run T: 5.4 steps/s). Here each layer
pads the batch to [B, L_max] and makes one causal attention call. Right padding under a causal mask is
exact for every real query (its keys all precede it, so no padded key is ever visible); the padded
queries' rows are computed and dropped. The cost is B·L_max² attention work instead of Σ L_i², which
is ~12% of the target's FLOPs at ~1k tokens on a 0.5B model.

Sequences are grouped so one group's fp32 score tensor stays under ``SCORE_BYTES`` on the CPU, whose
math attention materialises it (CUDA's memory-efficient kernel does not: ``SCORE_BYTES_CUDA`` only
bounds a fallback), so very long batches still fit.
Full attention and sliding windows (a banded mask) alike; ContiguousKV stays the reference.

    kv = PaddedPrefill.for_model(model.config)
    positions = kv.begin([(0, 300), (1, 120)])     # every sequence new: positions 0..n-1 each
    out = model(ids, positions, kv)
"""
from __future__ import annotations

from typing import Hashable, Sequence

import torch
import torch.nn.functional as F
from torch import Tensor

from specd.models.config import ModelConfig

SCORE_BYTES = 1 << 30        # a group's [B, Hq, L, L] fp32 scores at most on the CPU (1 GiB): its math path builds them
SCORE_BYTES_CUDA = 1 << 33   # on CUDA the memory-efficient kernel builds none; 8 GiB only bounds a math fallback


class PaddedPrefill:
    def __init__(self, num_layers: int, windows: Sequence[int | None] | None = None):
        self.num_layers = num_layers
        self.windows = tuple(windows) if windows is not None else (None,) * num_layers
        if len(self.windows) != num_layers:
            raise ValueError(f"{len(self.windows)} windows for {num_layers} layers")
        self._groups: list[_Group] = []
        self._total = 0

    @classmethod
    def for_model(cls, config: ModelConfig) -> "PaddedPrefill":
        return cls(config.num_layers, config.layer_windows)

    def begin(self, segments: Sequence[tuple[Hashable, int]], device: str | torch.device = "cpu",
              num_heads: int = 1) -> Tensor:
        """Declare the batch: (sequence id, length) in flat order, every sequence whole and new.
        Returns positions [T] (0..n-1 per sequence). ``num_heads`` only sizes the groups."""
        if len({seq for seq, _ in segments}) != len(segments):
            raise ValueError("a sequence may appear once per batch")
        sizes = [n for _, n in segments]
        if any(n <= 0 for n in sizes):
            raise ValueError(f"every sequence needs at least one token, got lengths {sizes}")
        device = torch.device(device)
        budget = SCORE_BYTES_CUDA if device.type == "cuda" else SCORE_BYTES
        self._groups, start, group = [], 0, []
        for n in sizes:
            longest = max([n, *(m for _, m in group)])
            if group and (len(group) + 1) * num_heads * longest * longest * 4 > budget:
                self._groups.append(_Group(group, device))
                group = []
            group.append((start, n))
            start += n
        if group:
            self._groups.append(_Group(group, device))
        self._total = start
        return torch.cat([torch.arange(n, device=device) for n in sizes])

    def __call__(self, layer: int, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        """q: [T, Hq, D]; k, v: [T, Hkv, D] (rotated) -> [T, Hq, D]."""
        if q.shape[0] != self._total:
            raise ValueError(f"batch declared {self._total} tokens, got {q.shape[0]}")
        outs = [g.attend(q, k, v, self.windows[layer]) for g in self._groups]
        return outs[0] if len(outs) == 1 else torch.cat(outs)


class _Group:
    """Index tensors of sequences attended in one call: flat token -> (row, column) of [B, L_max]."""

    def __init__(self, spans: list[tuple[int, int]], device: torch.device):
        sizes = torch.tensor([n for _, n in spans])
        self.rows, self.length = len(spans), int(sizes.max())
        self.first, self.tokens = spans[0][0], int(sizes.sum())
        col = torch.cat([torch.arange(n) for _, n in spans])
        row = torch.repeat_interleave(torch.arange(len(spans)), sizes)
        self.flat = (row * self.length + col).to(device)                    # [tokens] into [B * L_max]

    def attend(self, q: Tensor, k: Tensor, v: Tensor, window: int | None) -> Tensor:
        sl = slice(self.first, self.first + self.tokens)
        qp, kp, vp = (self._pad(t[sl]) for t in (q, k, v))                   # [B, H, L, D]
        group = q.shape[1] // k.shape[1]
        if group > 1:        # expand K/V heads: keeps CUDA's memory-efficient kernel (no enable_gqa there)
            kp, vp = kp.repeat_interleave(group, dim=1), vp.repeat_interleave(group, dim=1)
        if window is None:
            out = F.scaled_dot_product_attention(qp, kp, vp, is_causal=True)
        else:
            pos = torch.arange(self.length, device=q.device)
            mask = (pos[None] <= pos[:, None]) & (pos[None] > pos[:, None] - window)
            out = F.scaled_dot_product_attention(qp, kp, vp, attn_mask=mask)
        return out.transpose(1, 2).reshape(self.rows * self.length, q.shape[1], q.shape[2])[self.flat]

    def _pad(self, x: Tensor) -> Tensor:
        """[tokens, H, D] -> [B, H, L_max, D], zeros past each sequence's end."""
        out = x.new_zeros(self.rows * self.length, x.shape[1], x.shape[2])
        out[self.flat] = x
        return out.view(self.rows, self.length, x.shape[1], x.shape[2]).transpose(1, 2)
