"""Speculative decoding inside the engine: propose draft tokens, verify them in the same forward pass
as everything else, keep the longest accepted prefix.

Lossless by construction: the target distribution at every verified position goes through exactly
the transform a plain step samples from (``sampler.sampling_probs``: temperature, top-k, top-p, fp32),
the draft distribution is exactly what the drafter sampled from (one-hot for deterministic proposals
and greedy drafts), and ``kernels.rejection_sample`` accepts with min(1, p_t/p_d), resamples a
rejection from norm(max(p_t - p_d, 0)) and adds a bonus token when every draft passes. Greedy requests
(temperature 0) get one-hot target rows, so they emit exactly the target's argmax chain.

KV rollback needs no copy: the pool slots of rejected drafts lie beyond the sequence's computed length
and are overwritten by the next step; blocks are published only up to the computed length.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol, Sequence as Seq

import torch

import kernels
from specd.engine.sampler import draw_uniforms, sampling_probs
from specd.sampling_params import SamplingParams

METHODS = ("none", "ngram", "dspark", "dflash", "eagle3")


@dataclass
class Draft:
    """One sequence's proposal for this step."""

    tokens: list[int]                   # k draft tokens, k may be 0
    probs: torch.Tensor | None = None   # [k, V] fp32 the tokens were sampled from; None = one-hot (deterministic)
    confidence: list[float] | None = None   # [k] raw conditional survival c_j (DSpark's head); None = no head

    def truncated(self, k: int) -> "Draft":
        """The first k drafts: still lossless, a prefix of the block is verified exactly like the block."""
        return Draft(self.tokens[:k], None if self.probs is None else self.probs[:k],
                     None if self.confidence is None else self.confidence[:k])


class Proposer(Protocol):
    method: str
    capture_layers: tuple[int, ...]     # target layers whose outputs the proposer reads (empty: none)

    def propose(self, seqs: Seq, limits: Seq[int]) -> list[Draft]:
        """One batched proposal for all sequences (``specd.engine.sequence.Sequence``: tokens,
        sampling params, generator, draft features); sequence i gets at most ``limits[i]`` tokens."""

    def fuse(self, captured: Seq[torch.Tensor]) -> torch.Tensor:
        """Captured target layer outputs ([n, d] each) -> the features the proposer keeps per token."""


def target_probs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """logits: [n, V] -> the distribution a plain step would sample from at each row, fp32 [n, V]."""
    if params.greedy:
        return torch.zeros_like(logits, dtype=torch.float32).scatter_(1, logits.argmax(1, keepdim=True), 1.0)
    n = logits.shape[0]
    dev = logits.device
    return sampling_probs(logits, torch.full((n,), params.temperature, device=dev),
                          torch.full((n,), params.top_k, dtype=torch.int64, device=dev),
                          torch.full((n,), params.top_p, device=dev))


def draft_probs(draft: Draft, vocab: int, device: torch.device) -> torch.Tensor:
    """[k, V]: the draft's own probabilities, or one-hot rows for a deterministic proposal."""
    if draft.probs is not None:
        return draft.probs.to(device=device, dtype=torch.float32)
    rows = torch.zeros(len(draft.tokens), vocab, device=device)
    if draft.tokens:
        rows[torch.arange(len(draft.tokens)), torch.tensor(draft.tokens, device=device)] = 1.0
    return rows


def verify(logits: Seq[torch.Tensor], drafts: Seq[Draft], params: Seq[SamplingParams],
           generators: Seq[torch.Generator | None]) -> list[list[int]]:
    """logits[i]: [k_i + 1, V] target logits at the last known token and each draft position.
    Returns, per sequence, the accepted drafts followed by one target-sampled token."""
    s = len(drafts)
    k_max = max(len(d.tokens) for d in drafts)
    vocab = logits[0].shape[1]
    dev = logits[0].device
    p_t = torch.zeros(s, k_max + 1, vocab, device=dev)
    p_d = torch.zeros(s, k_max, vocab, device=dev)
    toks = torch.zeros(s, k_max, dtype=torch.int64, device=dev)
    for i, (lg, d, p) in enumerate(zip(logits, drafts, params)):
        k = len(d.tokens)
        p_t[i, : k + 1] = target_probs(lg, p)
        if k:
            p_d[i, :k] = draft_probs(d, vocab, dev)
            toks[i, :k] = torch.tensor(d.tokens, device=dev)
    num = torch.tensor([len(d.tokens) for d in drafts], dtype=torch.int32, device=dev)
    u = draw_uniforms(generators, k_max + 1).to(dev)                   # [S, K+1]: K accept draws + 1 for the last token
    accepted, out = kernels.rejection_sample(p_t, p_d, toks, num, u[:, :k_max].contiguous(), u[:, k_max].contiguous())
    return [row[: a + 1] for row, a in zip(out.tolist(), accepted.tolist())]
