"""Batched sampling with per-request temperature, top-k, top-p and RNG.

``sampling_probs`` is the single definition of "the distribution a request samples from": the
speculative verifier must compare draft and target under exactly this transform, so nothing else
re-implements it. Work is in fp32 whatever the model dtype.
"""
from __future__ import annotations

from typing import Sequence

import torch

from specd.sampling_params import SamplingParams


def sampling_probs(logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """logits: [B, V]; temperature/top_p: [B] fp32 (temperature > 0); top_k: [B] int64 (0 = off).
    Returns probs [B, V] fp32 with the filtered tokens at exactly 0."""
    logits = logits.float() / temperature.unsqueeze(1)
    vocab = logits.shape[1]
    sorted_logits, order = torch.sort(logits, dim=1, descending=True)
    rank = torch.arange(vocab, device=logits.device).unsqueeze(0)
    k = torch.where(top_k > 0, top_k.clamp(max=vocab), torch.full_like(top_k, vocab)).unsqueeze(1)
    drop = rank >= k
    sorted_probs = torch.softmax(sorted_logits.masked_fill(drop, float("-inf")), dim=1)
    # top-p: keep the smallest prefix whose mass reaches p (the token that crosses p stays)
    mass_before = torch.cumsum(sorted_probs, dim=1) - sorted_probs
    drop |= mass_before >= top_p.unsqueeze(1)
    sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
    probs_sorted = torch.softmax(sorted_logits, dim=1)
    return torch.zeros_like(probs_sorted).scatter_(1, order, probs_sorted)


def inverse_cdf(probs: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
    """probs: [B, V]; uniforms: [B] in [0, 1). The token whose CDF interval holds u; never a zero-prob token."""
    cdf = torch.cumsum(probs, dim=1)
    u = (uniforms * cdf[:, -1]).unsqueeze(1)
    idx = torch.searchsorted(cdf, u, right=True).squeeze(1)
    return idx.clamp(max=probs.shape[1] - 1)


def draw_uniforms(generators: Sequence[torch.Generator | None], n: int = 1) -> torch.Tensor:
    """[B, n] fp32 uniforms, each row from its request's own CPU generator (unseeded rows use the global RNG)."""
    rows = [torch.rand(n, generator=g) for g in generators]
    return torch.stack(rows) if rows else torch.empty(0, n)


def sample(logits: torch.Tensor, params: Sequence[SamplingParams], generators: Sequence[torch.Generator | None]) -> torch.Tensor:
    """logits: [B, V] -> token ids [B] int64 on logits.device."""
    device = logits.device
    out = torch.argmax(logits, dim=1)
    rows = [i for i, p in enumerate(params) if not p.greedy]
    if not rows:
        return out
    idx = torch.tensor(rows, device=device)
    temperature = torch.tensor([params[i].temperature for i in rows], dtype=torch.float32, device=device)
    top_k = torch.tensor([params[i].top_k for i in rows], dtype=torch.int64, device=device)
    top_p = torch.tensor([params[i].top_p for i in rows], dtype=torch.float32, device=device)
    probs = sampling_probs(logits[idx], temperature, top_k, top_p)
    u = draw_uniforms([generators[i] for i in rows]).squeeze(1).to(device)
    out[idx] = inverse_cdf(probs, u)
    return out
