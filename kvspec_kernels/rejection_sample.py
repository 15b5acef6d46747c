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
Grid ``(B,)``: one program walks its row's K drafts, then makes two passes over the vocabulary.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from kvspec_kernels.alignment import aligned
from kvspec_kernels.dispatch import use_triton
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
    fn = rejection_sample_triton if use_triton(target_probs.device) else rejection_sample_ref
    return fn(target_probs, draft_probs, draft_tokens, num_draft, uniforms, bonus_uniform)


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


def rejection_sample_triton(target_probs, draft_probs, draft_tokens, num_draft, uniforms, bonus_uniform):
    """Launch the Triton kernel; no host synchronisation. Misaligned inputs are copied first
    (kvspec_kernels/alignment.py: one kernel build, not one per alignment)."""
    _check_args(target_probs, draft_probs, draft_tokens, num_draft, uniforms, bonus_uniform)
    target_probs, draft_probs, draft_tokens, num_draft, uniforms, bonus_uniform = (
        aligned(t) for t in (target_probs, draft_probs, draft_tokens, num_draft, uniforms, bonus_uniform))
    batch, k_plus_1, vocab = target_probs.shape
    accepted_len = torch.empty(batch, dtype=torch.int32, device=target_probs.device)
    out = torch.empty((batch, k_plus_1), dtype=torch.int64, device=target_probs.device)
    if batch == 0:
        return accepted_len, out
    _rejection_sample_kernel[(batch,)](
        target_probs, draft_probs, draft_tokens, num_draft, uniforms, bonus_uniform, accepted_len, out,
        vocab,
        target_probs.stride(0), target_probs.stride(1), draft_probs.stride(0), draft_probs.stride(1),
        draft_tokens.stride(0), uniforms.stride(0), k_plus_1 - 1,
        BLOCK_V=min(BLOCK_V, triton.next_power_of_2(vocab)),
    )
    return accepted_len, out


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
# the H200 that was six compiles inside one timed 0.3 s run; docs/design/kernels.md).
@triton.jit(do_not_specialize=["vocab", "stride_tpb", "stride_tpk", "stride_dpb", "stride_dpk", "stride_tokb",
                               "stride_ub", "K"])
def _rejection_sample_kernel(
    tp_ptr, dp_ptr, tokens_ptr, num_draft_ptr, u_ptr, bonus_u_ptr, accepted_ptr, out_ptr,
    vocab,
    stride_tpb, stride_tpk, stride_dpb, stride_dpk, stride_tokb, stride_ub, K,
    BLOCK_V: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    num_draft = tl.load(num_draft_ptr + row)
    tp_row = tp_ptr + row * stride_tpb
    dp_row = dp_ptr + row * stride_dpb
    out_row = out_ptr + row * (K + 1)

    # Chain: ``alive`` stays 1 while every draft so far was accepted.
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
        tl.store(out_row + k, tl.where(alive == 1, token, -1))
    tl.store(out_row + K, -1)
    tl.store(accepted_ptr + row, accepted)

    # The last token: residual at the rejected position, or the target row after a full accept.
    rejected = accepted < num_draft
    tp_last = tp_row + accepted * stride_tpk
    dp_last = dp_row + tl.minimum(accepted, K - 1) * stride_dpk
    offs = tl.arange(0, BLOCK_V)
    # p_d is read only where it is subtracted (idx < end); masks are built by comparison, since
    # the interpreter turns ``block_mask & scalar_bool`` into an int32 mask it refuses.
    draft_end = tl.where(rejected, vocab, 0)
    total_res = 0.0
    total_tp = 0.0
    last_res = -1
    last_tp = -1
    for start in range(0, vocab, BLOCK_V):
        idx = start + offs
        mask = idx < vocab
        p_t = tl.load(tp_last + idx, mask=mask, other=0.0)
        p_d = tl.load(dp_last + idx, mask=idx < draft_end, other=0.0)
        res = tl.maximum(p_t - p_d, 0.0)
        total_res += tl.sum(res, 0)
        total_tp += tl.sum(p_t, 0)
        last_res = tl.maximum(last_res, tl.max(tl.where(res > 0, idx, -1), 0))
        last_tp = tl.maximum(last_tp, tl.max(tl.where(p_t > 0, idx, -1), 0))
    use_res = rejected & (total_res > 0)
    threshold = tl.load(bonus_u_ptr + row) * tl.where(use_res, total_res, total_tp)
    draft_end = tl.where(use_res, vocab, 0)
    carry = 0.0
    below = 0
    for start in range(0, vocab, BLOCK_V):
        idx = start + offs
        mask = idx < vocab
        p_t = tl.load(tp_last + idx, mask=mask, other=0.0)
        p_d = tl.load(dp_last + idx, mask=idx < draft_end, other=0.0)
        w = tl.maximum(p_t - p_d, 0.0)
        cdf = carry + tl.cumsum(w, 0)
        below += tl.sum(((cdf <= threshold) & mask).to(tl.int32), 0)
        carry += tl.sum(w, 0)
    token = tl.minimum(below, tl.where(use_res, last_res, last_tp))
    tl.store(out_row + accepted, token.to(tl.int64))
