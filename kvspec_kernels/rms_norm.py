"""RMSNorm in one launch: y = w * cast(x / rms(x)), the statistics in fp32.

Why: the torch reference (specd.models.layers.RMSNorm's formula) is eight launches per call (upcast,
square, mean, add, rsqrt, multiply, downcast, weight), 49 calls a Qwen2.5-0.5B step. On the H200 (session
14, ``bench.step_profile``) a replayed decode step of 16 sequences ran ~1,000 kernels in 3.2 ms for 2.2 ms
of GPU time, and among its 14 largest kernel names 537 launches were elementwise, reduction and copy
kernels. A graph replays a launch in a few µs, so launches, not bytes, are the cost at decode.

Rounding follows the reference step by step: the normalised row is cast to the input's dtype before the
weight multiplies it, and that product is rounded once to the output dtype (bf16 × bf16 is an fp32
product rounded to bf16, as torch computes it). The only difference is the order of the sum of squares
(one fp32 ulp in the statistic, which rarely moves the normalised row's rounding by one ulp; the weight
times that ulp rounds to at most two ulps of the output where |w| < 2). On the H200 (session 15,
``bench.kernels_gpu``) 5 of 1.8 M outputs differed, by two ulps at most; the model runs this kernel by
default since then (``kernels.fused_elementwise``): a decode step of 16 sequences fell from 2.06 to 1.61 ms.
Grid ``(rows,)``: one program per row of the last dimension (a token, or a token's head for Qwen3's
q/k norms), the whole row in one tile (hidden sizes up to 16,384).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from kvspec_kernels.dispatch import fused_elementwise
from kvspec_kernels.errors import KernelArgumentError
from kvspec_kernels.rounding import downcast

MAX_DIM = 16384


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Triton or the torch reference depending on ``fused_elementwise(x.device)``."""
    if fused_elementwise(x.device):
        return rms_norm_triton(x, weight, eps)
    return rms_norm_ref(x, weight, eps)


def rms_norm_ref(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Reference: computed in fp32 and cast back (as transformers does, so bf16 matches)."""
    dtype = x.dtype
    y = x.float()
    y = y * torch.rsqrt(y.pow(2).mean(-1, keepdim=True) + eps)
    return weight * y.to(dtype)


def rms_norm_triton(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Launch the kernel over every row of ``x``'s last dimension; no host synchronisation."""
    _check_args(x, weight)
    dim = x.shape[-1]
    rows = x.reshape(-1, dim)
    out = torch.empty(x.shape, device=x.device, dtype=torch.promote_types(weight.dtype, x.dtype))
    if rows.shape[0] == 0:
        return out
    _rms_norm_kernel[(rows.shape[0],)](
        rows, weight, out, rows.stride(0), eps,
        DIM=dim, BLOCK_D=triton.next_power_of_2(dim),
    )
    return out


def _check_args(x: torch.Tensor, weight: torch.Tensor) -> None:
    if weight.dim() != 1 or x.dim() < 1 or x.shape[-1] != weight.shape[0]:
        raise KernelArgumentError(f"rms_norm: x [..., d] and weight [d], got {tuple(x.shape)} and {tuple(weight.shape)}")
    if x.shape[-1] > MAX_DIM:
        raise KernelArgumentError(f"rms_norm: the last dimension is at most {MAX_DIM}, got {x.shape[-1]}")
    if x.stride(-1) != 1 or weight.stride(0) != 1:
        raise KernelArgumentError("rms_norm: the last dimension of x and the weight must be contiguous")
    if x.device != weight.device:
        raise KernelArgumentError(f"rms_norm: x on {x.device}, weight on {weight.device}")


@triton.jit
def _rms_norm_kernel(x_ptr, w_ptr, out_ptr, stride_row, eps, DIM: tl.constexpr, BLOCK_D: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK_D)
    mask = cols < DIM
    x = tl.load(x_ptr + row * stride_row + cols, mask=mask, other=0.0)
    xf = x.to(tl.float32)
    mean_sq = tl.sum(xf * xf, 0) / DIM
    y = downcast(xf * (1.0 / tl.sqrt(mean_sq + eps)), x.dtype)     # the reference's downcast
    w = tl.load(w_ptr + cols, mask=mask, other=0.0)
    out = w.to(tl.float32) * y.to(tl.float32)
    tl.store(out_ptr + row * DIM + cols, downcast(out, out_ptr.dtype.element_ty), mask=mask)
