"""Lossless chain verification for speculative decoding (Leviathan et al. / Chen et al.).

For each row, draft token x_k (sampled from p_d) is accepted while ``u_k < min(1, p_t(x)/p_d(x))``.
At the first rejection the replacement comes from ``norm(max(p_t - p_d, 0))`` at that position;
if all ``num_draft`` drafts pass, a bonus token comes from ``p_t`` at position ``num_draft``. Either
way that last token is drawn by inverse CDF with the row's ``bonus_uniform``. The emitted token at
every position is then distributed exactly as the target's.

Exactness rules shared by the kernel and the reference (so they agree bit for bit given the same
uniforms, and greedy one-hot rows behave exactly):
- acceptance is ``u * p_d(x) < p_t(x)``, which equals ``u < min(1, p_t/p_d)`` for ``u`` in [0, 1)
  without a division; a one-hot p_d accepts iff p_t(x) == 1, i.e. the target's argmax is x.
- inverse CDF: the token is the number of CDF entries ``<= u * total`` (zero-mass tokens are never
  chosen), capped at the last token with mass (guards rounding when u is near 1).
- a rejection whose residual has no mass (only possible through rounding) samples from p_t.
Grid ``(B, parts)``: every part walks its row's K drafts, then the two passes over the vocabulary run split
into parts side by side (``vocab_splits``), and one program a row adds the parts' counts.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from kvspec_kernels.alignment import aligned
from kvspec_kernels.dispatch import rejection_splits, use_triton
from kvspec_kernels.errors import KernelArgumentError

# Vocabulary chunk per pass; Qwen's 151,936 tokens take 75 chunks per pass.
BLOCK_V = 2048


def rejection_sample(
    target_probs: torch.Tensor,   # [B, K+1, V] fp32
    draft_probs: torch.Tensor,    # [B, K, V] fp32
    draft_tokens: torch.Tensor,   # [B, K] int64
    num_draft: torch.Tensor,      # [B] int32, each <= K
    uniforms: torch.Tensor,       # [B, K] fp32 in [0, 1)
    bonus_uniform: torch.Tensor,  # [B] fp32 in [0, 1)
) -> tuple[torch.Tensor, torch.Tensor]:  # accepted_len [B] int32, out_tokens [B, K+1] int64
    """Triton or the torch reference depending on ``use_triton(target_probs.device)``."""
    if use_triton(target_probs.device):
        return rejection_sample_triton(target_probs, draft_probs, draft_tokens, num_draft, uniforms, bonus_uniform,
                                       splits=rejection_splits())
    return rejection_sample_ref(target_probs, draft_probs, draft_tokens, num_draft, uniforms, bonus_uniform)


def rejection_sample_ref(target_probs, draft_probs, draft_tokens, num_draft, uniforms, bonus_uniform):
    """Readable reference, vectorised over rows."""
    _check_args(target_probs, draft_probs, draft_tokens, num_draft, uniforms, bonus_uniform)
    batch, k_plus_1, vocab = target_probs.shape
    k_max = k_plus_1 - 1
    rows = torch.arange(batch, device=target_probs.device)
    positions = torch.arange(k_max, device=target_probs.device)
    valid = positions[None, :] < num_draft[:, None].long()                         # [B, K]
    tokens = torch.where(valid, draft_tokens, 0)
    p_t = target_probs[:, :k_max].gather(2, tokens[..., None])[..., 0]             # [B, K]
    p_d = draft_probs.gather(2, tokens[..., None])[..., 0]
    accept = (uniforms * p_d < p_t) & valid
    accepted_len = accept.long().cumprod(1).sum(1)                                # [B]
    rejected = accepted_len < num_draft.long()

    target_row = target_probs[rows, accepted_len]                                  # [B, V]
    residual = torch.zeros_like(target_row)
    if k_max > 0:
        draft_row = draft_probs[rows, accepted_len.clamp(max=k_max - 1)]
        residual = (target_row - draft_row).clamp_min(0.0)
    use_residual = rejected & (residual.sum(1) > 0)
    last = _inverse_cdf(torch.where(use_residual[:, None], residual, target_row), bonus_uniform)

    out = torch.full((batch, k_plus_1), -1, dtype=torch.int64, device=target_probs.device)
    out[:, :k_max] = torch.where(positions[None, :] < accepted_len[:, None], draft_tokens, -1)
    out[rows, accepted_len] = last
    return accepted_len.int(), out


def _inverse_cdf(weights: torch.Tensor, uniform: torch.Tensor) -> torch.Tensor:
    """weights: [B, V] >= 0 (unnormalised); uniform: [B] -> [B] int64 token ids."""
    threshold = uniform * weights.sum(1)
    below = (weights.cumsum(1) <= threshold[:, None]).sum(1)
    vocab = weights.shape[1]
    last_with_mass = vocab - 1 - (weights.flip(1) > 0).long().argmax(1)
    return torch.minimum(below, last_with_mass)


def rejection_sample_triton(target_probs, draft_probs, draft_tokens, num_draft, uniforms, bonus_uniform,
                            splits: int | None = None):
    """Launch the Triton kernels; no host synchronisation. Misaligned inputs are copied first
    (kvspec_kernels/alignment.py: one kernel build, not one per alignment). ``splits``: vocabulary parts a
    row's passes run in, in parallel (``vocab_splits``; 1: one program a row, as until session 46)."""
    _check_args(target_probs, draft_probs, draft_tokens, num_draft, uniforms, bonus_uniform)
    target_probs, draft_probs, draft_tokens, num_draft, uniforms, bonus_uniform = (
        aligned(t) for t in (target_probs, draft_probs, draft_tokens, num_draft, uniforms, bonus_uniform))
    batch, k_plus_1, vocab = target_probs.shape
    device = target_probs.device
    accepted_len = torch.empty(batch, dtype=torch.int32, device=device)
    out = torch.empty((batch, k_plus_1), dtype=torch.int64, device=device)
    if batch == 0:
        return accepted_len, out
    block = min(BLOCK_V, triton.next_power_of_2(vocab))
    chunks = triton.cdiv(vocab, block)
    parts = min(splits or vocab_splits(batch, chunks), chunks, MAX_SPLITS)
    span = triton.cdiv(chunks, parts) * block          # vocabulary entries a part covers (whole chunks)
    parts = triton.cdiv(vocab, span)
    sums = torch.empty((batch, MAX_SPLITS, 2), dtype=torch.float32, device=device)   # residual, target mass
    lasts = torch.empty((batch, MAX_SPLITS, 2), dtype=torch.int32, device=device)    # last index with mass
    below = torch.empty((batch, MAX_SPLITS), dtype=torch.int32, device=device)
    strides = (target_probs.stride(0), target_probs.stride(1), draft_probs.stride(0), draft_probs.stride(1),
               draft_tokens.stride(0), uniforms.stride(0), k_plus_1 - 1)
    _chain_and_mass_kernel[(batch, parts)](
        target_probs, draft_probs, draft_tokens, num_draft, uniforms, accepted_len, out, sums, lasts,
        vocab, span, *strides, BLOCK_V=block, MAX_PARTS=MAX_SPLITS)
    _cdf_count_kernel[(batch, parts)](
        target_probs, draft_probs, num_draft, bonus_uniform, accepted_len, sums, below,
        vocab, span, parts, *strides, BLOCK_V=block, MAX_PARTS=MAX_SPLITS)
    _last_token_kernel[(batch,)](
        num_draft, accepted_len, out, sums, lasts, below, parts, k_plus_1 - 1, MAX_PARTS=MAX_SPLITS)
    return accepted_len, out


# Parallel parts of a row's vocabulary passes. Why: with one program a row, a step of one request verified on
# one streaming multiprocessor, two passes over 151,936 fp32 entries of two rows: 0.20 ms a call on the H100
# at c = 1 (session 46, torch.profiler of fixed-γ dspark on coding, run ED), ~5% of a drafting step there,
# and the same 0.2 ms at any batch below the GPU's SM count (the rows run side by side, each as slow).
MAX_SPLITS = 128            # the partials' buffer width (a constexpr: one kernel build for every split count)
TARGET_PROGRAMS = 256       # programs a launch aims at: ~2 per SM of an H100/H200 (132 SMs)


def vocab_splits(batch: int, chunks: int) -> int:
    """Parts per row: enough for ``TARGET_PROGRAMS`` programs over the batch, at most one chunk a part."""
    return max(1, min(chunks, MAX_SPLITS, -(-TARGET_PROGRAMS // batch)))


def _check_args(target_probs, draft_probs, draft_tokens, num_draft, uniforms, bonus_uniform) -> None:
    if target_probs.dim() != 3:
        raise KernelArgumentError(f"target_probs must be [B, K+1, V], got {tuple(target_probs.shape)}")
    batch, k_plus_1, vocab = target_probs.shape
    expected = {
        "draft_probs": (draft_probs, (batch, k_plus_1 - 1, vocab), torch.float32),
        "draft_tokens": (draft_tokens, (batch, k_plus_1 - 1), torch.int64),
        "num_draft": (num_draft, (batch,), torch.int32),
        "uniforms": (uniforms, (batch, k_plus_1 - 1), torch.float32),
        "bonus_uniform": (bonus_uniform, (batch,), torch.float32),
        "target_probs": (target_probs, (batch, k_plus_1, vocab), torch.float32),
    }
    for name, (t, shape, dtype) in expected.items():
        if tuple(t.shape) != shape or t.dtype != dtype:
            raise KernelArgumentError(f"{name} must be {list(shape)} {dtype}, got {tuple(t.shape)} {t.dtype}")
    if target_probs.stride(2) != 1 or draft_probs.stride(2) != 1 or num_draft.stride(0) != 1:
        raise KernelArgumentError("the vocabulary dimension of the probabilities must be contiguous")
    if draft_tokens.dim() == 2 and k_plus_1 > 1 and (draft_tokens.stride(1) != 1 or uniforms.stride(1) != 1):
        raise KernelArgumentError("draft_tokens and uniforms must have contiguous rows")


# Every integer that follows the step's longest draft (K, and the strides K sets) is a plain runtime
# argument, never specialised: as a constexpr (or a specialised 1 / multiple of 16) each new longest draft
# compiled a new kernel, ~0.1 s, and the confidence scheduler picks a different one almost every step (on
# the H200 that was six compiles inside one timed 0.3 s run; docs/design/kernels.md). The split count and a
# part's span are runtime arguments for the same reason.
_RUNTIME = ["vocab", "span", "stride_tpb", "stride_tpk", "stride_dpb", "stride_dpk", "stride_tokb", "stride_ub", "K"]


@triton.jit
def _chain(tp_row, dp_row, tokens_ptr, u_ptr, row, num_draft, stride_tpk, stride_dpk, stride_tokb, stride_ub, K,
           out_row, write):
    """The acceptance chain of one row: ``alive`` stays 1 while every draft so far was accepted. Writes the
    chain's tokens (and -1 after it) where ``write``; returns the accepted count."""
    alive = 1
    accepted = 0
    for k in range(0, K):
        valid = k < num_draft
        token = tl.load(tokens_ptr + row * stride_tokb + k)
        safe = tl.where(valid, token, 0)
        p_t = tl.load(tp_row + k * stride_tpk + safe, mask=valid, other=0.0)
        p_d = tl.load(dp_row + k * stride_dpk + safe, mask=valid, other=0.0)
        u = tl.load(u_ptr + row * stride_ub + k)
        alive = alive * ((u * p_d < p_t) & valid).to(tl.int32)
        accepted += alive
        if write:
            tl.store(out_row + k, tl.where(alive == 1, token, -1))
    return accepted


@triton.jit(do_not_specialize=_RUNTIME)
def _chain_and_mass_kernel(
    tp_ptr, dp_ptr, tokens_ptr, num_draft_ptr, u_ptr, accepted_ptr, out_ptr, sums_ptr, lasts_ptr,
    vocab, span,
    stride_tpb, stride_tpk, stride_dpb, stride_dpk, stride_tokb, stride_ub, K,
    BLOCK_V: tl.constexpr, MAX_PARTS: tl.constexpr,
):
    """Grid (B, parts). Every part walks its row's chain (K loads; part 0 writes it), then sums its span of
    the last position's residual max(p_t - p_d, 0) and target mass, and finds the last index with mass of
    each: the first pass over the vocabulary, split."""
    row = tl.program_id(0).to(tl.int64)
    part = tl.program_id(1)
    num_draft = tl.load(num_draft_ptr + row)
    tp_row = tp_ptr + row * stride_tpb
    dp_row = dp_ptr + row * stride_dpb
    out_row = out_ptr + row * (K + 1)
    accepted = _chain(tp_row, dp_row, tokens_ptr, u_ptr, row, num_draft, stride_tpk, stride_dpk, stride_tokb,
                      stride_ub, K, out_row, part == 0)
    if part == 0:
        tl.store(out_row + K, -1)
        tl.store(accepted_ptr + row, accepted)
    rejected = accepted < num_draft
    tp_last = tp_row + accepted * stride_tpk
    dp_last = dp_row + tl.minimum(accepted, K - 1) * stride_dpk
    offs = tl.arange(0, BLOCK_V)
    # p_d is read only where it is subtracted (idx < end); masks are built by comparison, since
    # the interpreter turns ``block_mask & scalar_bool`` into an int32 mask it refuses.
    draft_end = tl.where(rejected, vocab, 0)
    lo = part * span
    hi = tl.minimum(lo + span, vocab)
    total_res = 0.0
    total_tp = 0.0
    last_res = -1
    last_tp = -1
    for start in range(lo, hi, BLOCK_V):
        idx = start + offs
        mask = idx < hi
        p_t = tl.load(tp_last + idx, mask=mask, other=0.0)
        p_d = tl.load(dp_last + idx, mask=(idx < draft_end) & mask, other=0.0)
        res = tl.maximum(p_t - p_d, 0.0)
        total_res += tl.sum(res, 0)
        total_tp += tl.sum(p_t, 0)
        last_res = tl.maximum(last_res, tl.max(tl.where(res > 0, idx, -1), 0))
        last_tp = tl.maximum(last_tp, tl.max(tl.where(p_t > 0, idx, -1), 0))
    slot = (row * MAX_PARTS + part) * 2
    tl.store(sums_ptr + slot, total_res)
    tl.store(sums_ptr + slot + 1, total_tp)
    tl.store(lasts_ptr + slot, last_res)
    tl.store(lasts_ptr + slot + 1, last_tp)


@triton.jit
def _row_weights(sums_ptr, row, part, parts, rejected, MAX_PARTS: tl.constexpr):
    """(use the residual?, the row's total of the weights sampled from, their sum over the parts before
    ``part``), from the first pass's partial sums: every part sums them in the same order."""
    p = tl.arange(0, MAX_PARTS)
    live = p < parts
    base = sums_ptr + (row * MAX_PARTS + p) * 2
    res = tl.load(base, mask=live, other=0.0)
    tp = tl.load(base + 1, mask=live, other=0.0)
    use_res = rejected & (tl.sum(res, 0) > 0)
    w = tl.where(use_res, res, tp)
    return use_res, tl.sum(w, 0), tl.sum(tl.where(p < part, w, 0.0), 0)


@triton.jit(do_not_specialize=_RUNTIME + ["parts"])
def _cdf_count_kernel(
    tp_ptr, dp_ptr, num_draft_ptr, bonus_u_ptr, accepted_ptr, sums_ptr, below_ptr,
    vocab, span, parts,
    stride_tpb, stride_tpk, stride_dpb, stride_dpk, stride_tokb, stride_ub, K,
    BLOCK_V: tl.constexpr, MAX_PARTS: tl.constexpr,
):
    """Grid (B, parts): the second pass, split. Each part counts its span's CDF entries at or below the
    row's threshold (the bonus uniform times the total), its CDF starting from the parts before it."""
    row = tl.program_id(0).to(tl.int64)
    part = tl.program_id(1)
    num_draft = tl.load(num_draft_ptr + row)
    accepted = tl.load(accepted_ptr + row)
    rejected = accepted < num_draft
    use_res, total, carry = _row_weights(sums_ptr, row, part, parts, rejected, MAX_PARTS)
    threshold = tl.load(bonus_u_ptr + row) * total
    tp_last = tp_ptr + row * stride_tpb + accepted * stride_tpk
    dp_last = dp_ptr + row * stride_dpb + tl.minimum(accepted, K - 1) * stride_dpk
    offs = tl.arange(0, BLOCK_V)
    draft_end = tl.where(use_res, vocab, 0)
    lo = part * span
    hi = tl.minimum(lo + span, vocab)
    below = 0
    for start in range(lo, hi, BLOCK_V):
        idx = start + offs
        mask = idx < hi
        p_t = tl.load(tp_last + idx, mask=mask, other=0.0)
        p_d = tl.load(dp_last + idx, mask=(idx < draft_end) & mask, other=0.0)
        w = tl.maximum(p_t - p_d, 0.0)
        cdf = carry + tl.cumsum(w, 0)
        below += tl.sum(((cdf <= threshold) & mask).to(tl.int32), 0)
        carry += tl.sum(w, 0)
    tl.store(below_ptr + row * MAX_PARTS + part, below)


@triton.jit(do_not_specialize=["parts", "K"])
def _last_token_kernel(num_draft_ptr, accepted_ptr, out_ptr, sums_ptr, lasts_ptr, below_ptr, parts, K,
                       MAX_PARTS: tl.constexpr):
    """Grid (B,): the token at the first unaccepted position, the parts' counts added, capped at the last
    index with mass of the weights sampled from (guards rounding when the uniform is near 1)."""
    row = tl.program_id(0).to(tl.int64)
    num_draft = tl.load(num_draft_ptr + row)
    accepted = tl.load(accepted_ptr + row)
    rejected = accepted < num_draft
    use_res, _total, _carry = _row_weights(sums_ptr, row, 0, parts, rejected, MAX_PARTS)
    p = tl.arange(0, MAX_PARTS)
    live = p < parts
    below = tl.sum(tl.load(below_ptr + row * MAX_PARTS + p, mask=live, other=0), 0)
    base = lasts_ptr + (row * MAX_PARTS + p) * 2
    last_res = tl.max(tl.load(base, mask=live, other=-1), 0)
    last_tp = tl.max(tl.load(base + 1, mask=live, other=-1), 0)
    token = tl.minimum(below, tl.where(use_res, last_res, last_tp))
    tl.store(out_ptr + row * (K + 1) + accepted, token.to(tl.int64))
