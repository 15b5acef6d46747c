"""Target features for a drafter: run the target over a token sequence and capture the layers it fuses.

The capture convention is DecoderModel's: layer i's residual output (HF `hidden_states[i+1]`), never
the final-normed last layer. Training and the tests use this one-sequence path; the serving engine
captures the same layers inside its own batched forward.
"""
from __future__ import annotations

from typing import Sequence

import torch
from torch import Tensor

from specd.models.contiguous import ContiguousKV
from specd.models.decoder import DecoderModel, ModelOutput


@torch.no_grad()
def target_features(target: DecoderModel, token_ids: Tensor, target_layers: Sequence[int]) -> ModelOutput:
    """token_ids: [T] int64 -> ModelOutput(hidden [T, d] final-normed, captured [T, d] per target layer)."""
    kv = ContiguousKV(target.config.num_layers)
    positions = kv.begin([("seq", token_ids.shape[0])], device=token_ids.device)
    return target(token_ids, positions, kv, capture_layers=list(target_layers))
