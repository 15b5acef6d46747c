"""NgramDrafter: prompt lookup, no weights. Find the longest suffix (n = ngram_max..1) of the token
history that occurred earlier, and propose the γ tokens that followed its most recent occurrence.

Proposals are deterministic, so their probs are one-hot: rejection sampling with a one-hot p_d stays
lossless at any temperature (accept x with p_t(x), else resample from p_t with x removed). A row may
propose fewer than γ tokens (even none); `DraftOutput.lengths` says how many, and slots past it hold
token 0 and must be ignored.
"""
from __future__ import annotations

from typing import Sequence

import torch

from specd.drafter.base import DraftOutput
from specd.drafter.config import DrafterConfig
from specd.sampling_params import SamplingParams


class NgramDrafter:
    def __init__(self, config: DrafterConfig):
        self.config = config

    def propose(self, history: Sequence[int]) -> list[int]:
        """Up to γ tokens continuing the most recent earlier occurrence of the longest matching suffix."""
        h = torch.tensor(list(history), dtype=torch.int64)
        for n in range(min(self.config.ngram_max, len(h) - 1), 0, -1):
            windows = h.unfold(0, n, 1)[:-1]                      # [L-n, n], all but the suffix itself
            hits = (windows == h[-n:]).all(dim=1).nonzero()
            if hits.numel():
                start = int(hits[-1]) + n
                return h[start:start + self.config.gamma].tolist()
        return []

    def draft(self, token_histories: Sequence[Sequence[int]], params: Sequence[SamplingParams] = (),
              generators: Sequence[torch.Generator | None] = ()) -> DraftOutput:
        """One proposal per history; params/generators are accepted for a uniform call but unused
        (the proposals are deterministic)."""
        del params, generators
        g, b = self.config.gamma, len(token_histories)
        tokens = torch.zeros(b, g, dtype=torch.int64)
        lengths = torch.zeros(b, dtype=torch.int64)
        for i, history in enumerate(token_histories):
            proposal = self.propose(history)
            tokens[i, :len(proposal)] = torch.tensor(proposal, dtype=torch.int64)
            lengths[i] = len(proposal)
        probs = torch.zeros(b, g, self.config.vocab_size).scatter_(2, tokens[..., None], 1.0)
        return DraftOutput(tokens=tokens, probs=probs, confidence=None, lengths=lengths)

    def num_parameters(self, trainable_only: bool = False) -> int:
        return 0

    def describe(self) -> str:
        return f"ngram: prompt lookup, n = {self.config.ngram_max}..1, up to γ={self.config.gamma} tokens"
