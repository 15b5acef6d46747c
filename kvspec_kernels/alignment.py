"""Kernel arguments at 16-byte-aligned addresses, so a kernel is built once, not once per alignment.

Why: Triton specialises every pointer argument on whether its address is a multiple of 16 bytes, and
builds the kernel again (~0.1-0.2 s on the H200) the first time an argument comes with the other
alignment. The sampling and verification inputs are views into packed uploads, whose offsets move with
the batch: a plain step's uniforms start 8·s bytes into their upload and its top-p values 4·s bytes (s
sampled rows), a verification's draft tokens start after Σ(k_i + 1) + S·(K + 1) int64 rows, and with one
verified request its bonus uniform sits 4·K bytes into the uniforms. So a serving process built new
variants whenever those counts first took another residue: on the H200 (session 16) fresh engines built
one kernel inside a timed run in runs AZ and BB, after warm-ups that had run the same batch shapes with
shorter answers. Copying a misaligned argument (they are small: [S] or [S, K]) costs one launch; the big
probability tensors are fresh allocations or views at offset 0, aligned already, and are never copied.
"""
from __future__ import annotations

import torch

ALIGN = 16   # bytes: the divisibility Triton specialises pointer arguments on


def aligned(t: torch.Tensor) -> torch.Tensor:
    """``t`` itself when its address is a multiple of ``ALIGN`` (or it is empty), else a copy (a fresh
    allocation, aligned; its strides are the copy's own, so read them after this call)."""
    if t.numel() == 0 or t.data_ptr() % ALIGN == 0:
        return t
    return t.clone(memory_format=torch.contiguous_format)
