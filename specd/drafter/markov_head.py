"""The Markov head: a low-rank bias from the previous token to each block slot's logits (DSpark §3.1).

p_k ∝ exp(U_k + W2·W1[x_{k-1}]). The block forward yields every U_k at once, but slot k's bias needs
the token *sampled* at slot k-1, so inference samples left to right (`sample_block`); training uses
the teacher-forced previous tokens and needs no loop. Parameter names follow DeepSpec's VanillaMarkov
(`markov_w1` embedding V×r, `markov_w2` linear r→V) so its checkpoints load.
"""
from __future__ import annotations

from typing import Callable

import torch
from torch import Tensor, nn


class MarkovHead(nn.Module):
    def __init__(self, vocab_size: int, rank: int):
        super().__init__()
        self.markov_w1 = nn.Embedding(vocab_size, rank)
        self.markov_w2 = nn.Linear(rank, vocab_size, bias=False)

    def prev_embedding(self, prev_tokens: Tensor) -> Tensor:
        """prev_tokens: [...] int64 -> W1[x] [..., r] (also the confidence head's token feature)."""
        return self.markov_w1(prev_tokens)

    def bias(self, prev_tokens: Tensor) -> Tensor:
        """prev_tokens: [...] int64 -> W2·W1[x] [..., V] in the head's dtype."""
        return self.markov_w2(self.prev_embedding(prev_tokens))

    def forward(self, base_logits: Tensor, prev_tokens: Tensor) -> Tensor:
        """base_logits: [..., V] fp32; prev_tokens: [...] int64 -> corrected logits [..., V] fp32.

        The bias goes into the fp32 add in its own dtype: a bf16 bias is upcast inside the add, exactly,
        so the sum is bit for bit ``base_logits + bias.float()`` without the separate upcast's kernel and
        its fp32 [B, V] pass (one of each a slot of the Markov loop)."""
        bias = self.bias(prev_tokens)
        return base_logits + (bias if base_logits.dtype == torch.float32 else bias.float())


def sample_block(base_logits: Tensor, anchors: Tensor, head: MarkovHead | None,
                 sample_slot: Callable[[Tensor, int], tuple[Tensor, Tensor]]) -> tuple[Tensor, Tensor]:
    """The Markov loop: slot k's logits get the bias of the token drawn at slot k-1 (slot 0: the anchor).

    base_logits: [B, gamma, V] fp32; anchors: [B] int64; `sample_slot(logits [B, V], k)` returns
    (tokens [B], probs [B, V]). Returns tokens [B, gamma] int64 and the probs [B, gamma, V] each token
    was drawn from. Without a head (DFlash) the slots are independent and the loop only samples.
    """
    prev, tokens, probs = anchors, [], []
    for k in range(base_logits.shape[1]):
        logits = base_logits[:, k] if head is None else head(base_logits[:, k], prev)
        prev, p = sample_slot(logits, k)
        tokens.append(prev)
        probs.append(p)
    return torch.stack(tokens, dim=1), torch.stack(probs, dim=1)
