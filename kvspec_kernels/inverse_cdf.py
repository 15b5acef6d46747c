"""Draw one token per row from unnormalised probabilities by inverse CDF, without a full-row cumsum.

Why: after the top-p transform stopped sorting (kvspec_kernels/nucleus.py), the draw itself was the largest
piece of a sampled draft round: torch's ``cumsum`` + ``searchsorted`` over [rows, 151,936] cost 0.07 ms
at 1 row and 0.22-0.35 ms at 4-256 rows on the H200 (`python -m bench.sampling_cost`), once per draft
position, seven positions a round.

The rule (shared with the reference and kvspec_kernels/rejection_sample.py): the token is the number of CDF
entries ``<= u * total``, capped at the last token with mass, so a zero-probability token is never
drawn, whatever the rounding when u is close to 1.

Two launches: ``_chunk_sums`` (grid ``(rows, chunks)``) sums each chunk of CHUNK tokens; ``_pick`` (one
program per row) runs the inclusive prefix over the chunk sums, takes the first chunk whose prefix
passes ``u * total`` and counts inside that chunk alone. The chunk sums and the in-chunk running sum
round differently, so the crossing can fall past the chunk's end: the cap then takes the chunk's last
token with mass (a token of positive probability either way).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from kvspec_kernels.alignment import aligned
from kvspec_kernels.dispatch import use_triton
from kvspec_kernels.errors import KernelArgumentError

CHUNK = 4096


def draw(probs: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
    """probs: [R, V] fp32 >= 0; uniforms: [R] fp32 in [0, 1). -> [R] int64. A row without mass (a bug
    upstream) draws token V - 1 rather than fail."""
    fn = draw_triton if use_triton(probs.device) else draw_ref
    return fn(probs, uniforms)


def draw_ref(probs: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
    _check_args(probs, uniforms)
    cdf = torch.cumsum(probs, dim=1)
    below = (cdf <= (uniforms * cdf[:, -1]).unsqueeze(1)).sum(dim=1)
    last_with_mass = probs.shape[1] - 1 - (probs.flip(1) > 0).long().argmax(dim=1)
    return torch.minimum(below, last_with_mass)


def draw_triton(probs: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
    """Two launches, no host synchronisation (capturable in a CUDA graph); misaligned inputs are copied
    first (kvspec_kernels/alignment.py)."""
    _check_args(probs, uniforms)
    probs, uniforms = aligned(probs), aligned(uniforms)
    rows, vocab = probs.shape
    out = torch.empty(rows, dtype=torch.int64, device=probs.device)
    if rows == 0:
        return out
    chunks = triton.cdiv(vocab, CHUNK)
    sums = torch.empty((rows, chunks), dtype=torch.float32, device=probs.device)
    _chunk_sums[(rows, chunks)](probs, sums, vocab, probs.stride(0), CHUNK=CHUNK, num_warps=8)
    _pick[(rows,)](probs, uniforms, sums, out, vocab, probs.stride(0), uniforms.stride(0), chunks,
                   CHUNK=CHUNK, BLOCK_S=triton.next_power_of_2(chunks), num_warps=8)
    return out


def _check_args(probs: torch.Tensor, uniforms: torch.Tensor) -> None:
    if probs.dim() != 2 or probs.dtype != torch.float32 or probs.shape[1] == 0:
        raise KernelArgumentError(f"probs must be [R, V>0] fp32, got {tuple(probs.shape)} {probs.dtype}")
    if tuple(uniforms.shape) != (probs.shape[0],) or uniforms.dtype != torch.float32:
        raise KernelArgumentError(f"uniforms must be [{probs.shape[0]}] fp32, got {tuple(uniforms.shape)} "
                                  f"{uniforms.dtype}")
    if probs.stride(1) != 1:
        raise KernelArgumentError("the vocabulary dimension of probs must be contiguous")
    if probs.device != uniforms.device:
        raise KernelArgumentError(f"probs on {probs.device}, uniforms on {uniforms.device}")


@triton.jit
def _chunk_sums(probs_ptr, sums_ptr, vocab, stride_p, CHUNK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    c = tl.program_id(1)
    idx = c * CHUNK + tl.arange(0, CHUNK)
    p = tl.load(probs_ptr + row * stride_p + idx, mask=idx < vocab, other=0.0)
    tl.store(sums_ptr + row * tl.num_programs(1) + c, tl.sum(p, 0))


# stride_u is 1 for a plain step's uniforms and γ for a draft round's column: not specialised, so both
# share one compiled kernel (the engine builds it at start, sampler.warm)
@triton.jit(do_not_specialize=["stride_u"])
def _pick(probs_ptr, u_ptr, sums_ptr, out_ptr, vocab, stride_p, stride_u, chunks,
          CHUNK: tl.constexpr, BLOCK_S: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    s = tl.arange(0, BLOCK_S)
    real = s < chunks
    sums = tl.load(sums_ptr + row * chunks + s, mask=real, other=0.0)
    through = tl.cumsum(sums, 0)
    total = tl.sum(tl.where(s == chunks - 1, through, 0.0), 0)
    threshold = tl.load(u_ptr + row * stride_u) * total
    last_chunk = tl.max(tl.where(real & (sums > 0), s, -1), 0)
    # a row without mass (all zeros, or NaN) draws the last token, as the reference does for zeros: never
    # a read outside the row
    chosen = tl.where(last_chunk >= 0,
                      tl.minimum(tl.sum(((through <= threshold) & real).to(tl.int32), 0), last_chunk), chunks - 1)
    carry = tl.sum(tl.where(s < chosen, sums, 0.0), 0)
    idx = chosen * CHUNK + tl.arange(0, CHUNK)
    inside = idx < vocab
    p = tl.load(probs_ptr + row * stride_p + idx, mask=inside, other=0.0)
    cdf = carry + tl.cumsum(p, 0)
    below = tl.sum(((cdf <= threshold) & inside).to(tl.int32), 0)
    last = tl.max(tl.where(p > 0, tl.arange(0, CHUNK), -1), 0)
    token = tl.where(last >= 0, chosen * CHUNK + tl.minimum(below, last), vocab - 1)
    tl.store(out_ptr + row, token.to(tl.int64))
