"""The confidence head: P(slot k survives verification | slot k-1 survived), from [h_k ; W1[x_{k-1}]].

The feature includes the *sampled* previous token (through the Markov head's W1), because whether
slot k is accepted depends on what was drafted before it. Output is a pre-sigmoid logit; training uses
BCE against 1 - ½‖p_d - p_t‖₁ and calibration (STS) happens elsewhere, after this raw value. The
parameter is named `proj` inside `confidence_head`, as in DeepSpec's AcceptRatePredictor.
"""
from __future__ import annotations

import torch
from torch import Tensor, nn


class ConfidenceHead(nn.Module):
    def __init__(self, hidden_size: int, markov_rank: int):
        super().__init__()
        self.proj = nn.Linear(hidden_size + markov_rank, 1)

    def forward(self, hidden: Tensor, prev_embedding: Tensor) -> Tensor:
        """hidden: [..., d]; prev_embedding: [..., r] = W1[x_{k-1}] -> logits [...] fp32."""
        features = torch.cat([hidden, prev_embedding.to(hidden.dtype)], dim=-1)
        return self.proj(features).squeeze(-1).float()
