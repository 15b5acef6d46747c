"""Training's anchors of several sequences as one padded [B, N_max] grid, checked on the host.

Both batched training forwards (``BlockDrafter.block_logits_batch``, ``Eagle3Drafter.ttt_logits_batch``)
take each sequence's anchors as its own [N_i] tensor and run every sequence in one padded forward. They
check the anchors and lay them out the same way; this is that part, once. It works on host copies, so
checking a device tensor's range costs no device sync per sequence.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch
from torch import Tensor

from specd.drafter.base import DrafterError


@dataclass
class AnchorRows:
    anchor: Tensor      # [B, N_max] int64 on the device: sequence i's anchors, then ``pad``
    real: Tensor        # [B, N_max] bool on the device: which entries are real anchors
    counts: list[int]   # N_i


def anchor_rows(contexts: Sequence[Tensor], tokens: Sequence[Tensor], anchors: Sequence[Tensor],
                lo: int, tail: int, pad: int, what: str) -> AnchorRows:
    """Check and pad the anchors: sequence i's context rows must number its tokens T_i, and each of its
    anchors a (at least one) must satisfy ``lo <= a <= T_i - 1 - tail``. Padded entries hold ``pad`` (an
    anchor every sequence accepts, dropped later through ``real``). ``what`` names the forward in errors.
    Raises DrafterError for mismatched lists, lengths or anchors out of range."""
    b = len(contexts)
    if not (b == len(tokens) == len(anchors)) or b == 0:
        raise DrafterError(f"{what}: {len(contexts)} contexts, {len(tokens)} token rows, {len(anchors)} anchor rows")
    counts = [a.numel() for a in anchors]
    cpu = [a.detach().to("cpu") for a in anchors]
    for c, t, a in zip(contexts, tokens, cpu):
        n = int(t.shape[0])
        if c.shape[0] != n:
            raise DrafterError(f"{what}: a context has {c.shape[0]} positions, its tokens {n}")
        hi = n - 1 - tail
        if a.numel() == 0 or int(a.min()) < lo or int(a.max()) > hi:
            raise DrafterError(f"{what}: each sequence needs anchors in [{lo}, {hi}] (T = {n}), got {a.tolist()}")
    anchor = torch.full((b, max(counts)), pad, dtype=torch.int64)
    real = torch.zeros(b, max(counts), dtype=torch.bool)
    for i, a in enumerate(cpu):
        anchor[i, :counts[i]] = a
        real[i, :counts[i]] = True
    dev = tokens[0].device
    return AnchorRows(anchor.to(dev), real.to(dev), counts)
