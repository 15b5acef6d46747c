"""Batched sampling with per-request temperature, top-k, top-p and RNG.

``sampling_probs`` is the single definition of "the distribution a request samples from": the
speculative verifier must compare draft and target under exactly this transform, so nothing else
re-implements it. Work is in fp32 whatever the model dtype.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch

from specd.sampling_params import SamplingParams


@dataclass(frozen=True)
class RowKinds:
    """Which transform each row of a batch needs, decided on the host from the requests' settings, so
    choosing a path costs no device sync. Each row's path depends on its own settings only: a row's
    probabilities never depend on which other requests share its batch."""

    plain: tuple[int, ...]     # no top-k, top-p ≥ 1: one softmax, no sort
    top_k: tuple[int, ...]     # top-k (top-p applied inside the k): torch.topk, no full sort
    top_p: tuple[int, ...]     # top-p without top-k: the full sort
    max_k: int = 0             # the largest k of the top_k rows

    @classmethod
    def of(cls, top_k: Sequence[int], top_p: Sequence[float], vocab: int) -> "RowKinds":
        limited = [0 < k < vocab for k in top_k]
        return cls(tuple(i for i, (lim, p) in enumerate(zip(limited, top_p)) if not lim and p >= 1.0),
                   tuple(i for i, lim in enumerate(limited) if lim),
                   tuple(i for i, (lim, p) in enumerate(zip(limited, top_p)) if not lim and p < 1.0),
                   max((k for k, lim in zip(top_k, limited) if lim), default=0))


def sampling_probs(logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor,
                   kinds: RowKinds | None = None) -> torch.Tensor:
    """logits: [B, V]; temperature/top_p: [B] fp32 (temperature > 0); top_k: [B] int64 (0 = off).
    Returns probs [B, V] fp32 with the filtered tokens at exactly 0.

    ``kinds``: the rows' paths when the caller knows the settings on the host (else read from the
    tensors: one sync). Only rows with top-p and no top-k sort the whole vocabulary; a top-k row sorts
    its k candidates (``torch.topk``), an unfiltered row is one softmax."""
    logits = logits.float() / temperature.unsqueeze(1)
    vocab = logits.shape[1]
    if kinds is None:
        kinds = RowKinds.of(top_k.tolist(), top_p.tolist(), vocab)
    parts = [(rows, fn) for rows, fn in ((kinds.plain, None), (kinds.top_k, _top_k_probs), (kinds.top_p, _top_p_probs))
             if rows]
    if len(parts) == 1:                                   # one kind: no gather or scatter of rows
        fn = parts[0][1]
        return torch.softmax(logits, dim=1) if fn is None else fn(logits, top_k, top_p, kinds.max_k)
    out = torch.empty_like(logits)
    for rows, fn in parts:
        idx = torch.tensor(rows, dtype=torch.int64, device=logits.device)
        out[idx] = (torch.softmax(logits[idx], dim=1) if fn is None
                    else fn(logits[idx], top_k[idx], top_p[idx], kinds.max_k))
    return out


def _top_k_probs(logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor, max_k: int) -> torch.Tensor:
    """Rows with 0 < top_k < V: the max_k largest logits, sorted (torch.topk), are all a row can keep."""
    values, order = torch.topk(logits, max_k, dim=1)
    return _filter_sorted(values, order, top_k, top_p, logits.shape[1])


def _top_p_probs(logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor, max_k: int) -> torch.Tensor:
    """Rows with top-p and no top-k: the nucleus needs the whole vocabulary sorted."""
    values, order = torch.sort(logits, dim=1, descending=True)
    return _filter_sorted(values, order, top_k, top_p, logits.shape[1])


def _filter_sorted(values: torch.Tensor, order: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor,
                   vocab: int) -> torch.Tensor:
    """values/order: [B, n] logits sorted descending and their token ids (n ≤ vocab) -> probs [B, vocab]."""
    rank = torch.arange(values.shape[1], device=values.device).unsqueeze(0)
    k = torch.where(top_k > 0, top_k.clamp(max=vocab), torch.full_like(top_k, vocab)).unsqueeze(1)
    drop = rank >= k
    sorted_probs = torch.softmax(values.masked_fill(drop, float("-inf")), dim=1)
    # top-p: keep the smallest prefix whose mass reaches p (the token that crosses p stays)
    mass_before = torch.cumsum(sorted_probs, dim=1) - sorted_probs
    drop |= mass_before >= top_p.unsqueeze(1)
    probs_sorted = torch.softmax(values.masked_fill(drop, float("-inf")), dim=1)
    return torch.zeros(values.shape[0], vocab, device=values.device).scatter_(1, order, probs_sorted)


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
    kinds = RowKinds.of([params[i].top_k for i in rows], [params[i].top_p for i in rows], logits.shape[1])
    probs = sampling_probs(logits[idx], temperature, top_k, top_p, kinds)
    u = draw_uniforms([generators[i] for i in rows]).squeeze(1).to(device)
    out[idx] = inverse_cdf(probs, u)
    return out
