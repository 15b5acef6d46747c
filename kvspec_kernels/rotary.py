"""Rotary position embedding in one launch: x * cos + rotate_half(x) * sin, per token and head.

Why: the torch reference (specd.models.layers.apply_rotary's formula) is five launches per tensor (the
negated half, the concatenation, two products and a sum), ten a layer for q and k, 240 a Qwen2.5-0.5B
step, where a replayed decode step is bound by its ~1,000 launches (kvspec_kernels/rms_norm.py says more).

Rounding follows the reference: each product is rounded to the input dtype, then their sum (bf16 tensors
multiply as fp32 products rounded to bf16 in torch). In fp32 the compiler may contract a product and the
sum into one fused multiply-add (one ulp; the tests bound it). The rotate-half pairing is HF's: dimension
i with i + D/2. Grid ``(T,)``: one program per token, every head of it in one [heads, D] tile.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from kvspec_kernels.dispatch import fused_elementwise
from kvspec_kernels.errors import KernelArgumentError
from kvspec_kernels.rounding import downcast


def rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Triton or the torch reference depending on ``fused_elementwise(x.device)``."""
    if fused_elementwise(x.device):
        return rotary_triton(x, cos, sin)
    return rotary_ref(x, cos, sin)


def rotary_ref(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Reference. x: [T, H, D]; cos, sin: [T, 1, D]."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


def rotary_triton(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Launch the kernel; returns a new contiguous [T, H, D] tensor. No host synchronisation."""
    _check_args(x, cos, sin)
    t, heads, dim = x.shape
    out = torch.empty((t, heads, dim), device=x.device, dtype=x.dtype)
    if t == 0:
        return out
    _rotary_kernel[(t,)](
        x, cos, sin, out, x.stride(0), x.stride(1), cos.stride(0), sin.stride(0),
        HEADS=heads, DIM=dim, BLOCK_H=triton.next_power_of_2(heads), BLOCK_D=triton.next_power_of_2(dim),
    )
    return out


def _check_args(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> None:
    if x.dim() != 3 or x.shape[-1] % 2:
        raise KernelArgumentError(f"rotary: x must be [T, H, D] with an even D, got {tuple(x.shape)}")
    t, _, dim = x.shape
    for name, table in (("cos", cos), ("sin", sin)):
        if table.shape != (t, 1, dim) or table.stride(-1) != 1:
            raise KernelArgumentError(f"rotary: {name} must be [T, 1, D] = {(t, 1, dim)} with a contiguous last "
                                      f"dimension, got {tuple(table.shape)}")
        if table.dtype != x.dtype or table.device != x.device:
            raise KernelArgumentError(f"rotary: {name} is {table.dtype} on {table.device}, x {x.dtype} on {x.device}")
    if x.stride(-1) != 1:
        raise KernelArgumentError("rotary: the last dimension of x must be contiguous")


@triton.jit
def _rotary_kernel(x_ptr, cos_ptr, sin_ptr, out_ptr, stride_xt, stride_xh, stride_ct, stride_st,
                   HEADS: tl.constexpr, DIM: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr):
    tok = tl.program_id(0).to(tl.int64)
    heads = tl.arange(0, BLOCK_H)[:, None]
    cols = tl.arange(0, BLOCK_D)[None, :]
    mask = (heads < HEADS) & (cols < DIM)
    half: tl.constexpr = DIM // 2
    partner = tl.where(cols < half, cols + half, cols - half)
    base = x_ptr + tok * stride_xt + heads * stride_xh
    x = tl.load(base + cols, mask=mask, other=0.0)
    other = tl.load(base + partner, mask=mask, other=0.0).to(tl.float32)
    rotated = tl.where(cols < half, -other, other)     # negated in fp32 (exact): the interpreter (3.9) negates
                                                       # bf16 as raw 16-bit integers
    c = tl.load(cos_ptr + tok * stride_ct + cols, mask=cols < DIM, other=0.0)
    s = tl.load(sin_ptr + tok * stride_st + cols, mask=cols < DIM, other=0.0)
    a = downcast(x.to(tl.float32) * c.to(tl.float32), x.dtype)
    b = downcast(rotated * s.to(tl.float32), x.dtype)
    out = downcast(a.to(tl.float32) + b.to(tl.float32), x.dtype)
    tl.store(out_ptr + tok * (HEADS * DIM) + heads * DIM + cols, out, mask=mask)
