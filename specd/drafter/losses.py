"""Drafter training losses: DSpark's distillation mix, DFlash's CE, EAGLE-3's training-time-test CE.

DSpark (paper §3, DeepSpec's trainer): ``0.1·CE + 0.9·L1(p_d, p_t) + 1.0·BCE(confidence)``, every term
weighted per block slot by ``exp(−(k−1)/4)`` (DeepSpec's code uses a decay constant of 4; the paper text
says γ) and averaged over the slots that have a label.

- ``p_t`` is the target's softmax at **T = 1** over its own logits at the position that predicts the slot's
  token, whatever temperature generated the data: the drafter should learn the target's whole distribution,
  and serving-time temperature / top-k / top-p are applied to both models identically afterwards.
- ``p_d`` is the softmax of the *Markov-corrected* logits (teacher-forced previous tokens), i.e. the
  distribution the drafter samples from at T = 1.
- ``L1`` is the full ``‖p_d − p_t‖₁`` (range [0, 2]); the confidence label is ``1 − ½‖p_d − p_t‖₁``, the
  probability that a token drawn from p_d survives rejection sampling against p_t (detached: the label must
  not pull the drafter towards being easy to predict).
- CE is against the target's regenerated token (the data), so it is a sample of p_t.

Everything is pure tensor math so the tests can check exact values on tiny tensors.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

CE_WEIGHT, L1_WEIGHT, BCE_WEIGHT = 0.1, 0.9, 1.0
POSITION_DECAY = 4.0       # DeepSpec code: exp(-(k-1)/4)
EAGLE_STEP_DECAY = 0.8     # DeepSpec's EAGLE-3 baseline: TTT step k weighted 0.8^(k-1)


@dataclass
class LossParts:
    """The total that is back-propagated and its detached components (for the loss curves)."""
    total: Tensor
    ce: float
    l1: float = 0.0
    bce: float = 0.0


def position_weights(gamma: int, decay: float = POSITION_DECAY, device: torch.device | str = "cpu") -> Tensor:
    """[γ] fp32: slot k (1-based) weighs exp(−(k−1)/decay)."""
    return torch.exp(-torch.arange(gamma, dtype=torch.float32, device=device) / decay)


def step_weights(steps: int, decay: float = EAGLE_STEP_DECAY, device: torch.device | str = "cpu") -> Tensor:
    """[steps] fp32: EAGLE-3 TTT step k (1-based) weighs decay^(k−1)."""
    return decay ** torch.arange(steps, dtype=torch.float32, device=device)


def weighted_mean(values: Tensor, weights: Tensor, valid: Tensor) -> Tensor:
    """values, valid: [N, γ]; weights: [γ]. Σ w·v over valid slots / Σ w over valid slots (0 if none)."""
    w = weights.unsqueeze(0) * valid.float()
    return (values * w).sum() / w.sum().clamp_min(1e-12)


def token_ce(logits: Tensor, labels: Tensor) -> Tensor:
    """logits: [N, γ, V]; labels: [N, γ] int64 (any value where invalid) -> [N, γ] per-slot CE."""
    safe = labels.clamp(0, logits.shape[-1] - 1)
    return F.cross_entropy(logits.flatten(0, 1).float(), safe.flatten(), reduction="none").view(labels.shape)


def l1_distance(p_d: Tensor, p_t: Tensor) -> Tensor:
    """p_d, p_t: [N, γ, V] probabilities -> [N, γ] ‖p_d − p_t‖₁."""
    return (p_d - p_t).abs().sum(-1)


def confidence_label(p_d: Tensor, p_t: Tensor) -> Tensor:
    """[N, γ]: 1 − ½‖p_d − p_t‖₁ = Σ min(p_d, p_t), the acceptance probability of a p_d sample; detached."""
    return (1.0 - 0.5 * l1_distance(p_d, p_t)).detach().clamp(0.0, 1.0)


def dspark_loss(
    logits: Tensor,          # [N, γ, V] Markov-corrected drafter logits (teacher-forced previous tokens)
    target_logits: Tensor,   # [N, γ, V] the target's logits at the positions predicting each slot's token
    labels: Tensor,          # [N, γ] int64, the target's regenerated tokens
    valid: Tensor,           # [N, γ] bool, slots that have a label
    conf_logits: Tensor | None,  # [N, γ] pre-sigmoid confidence, or None (no head)
    decay: float = POSITION_DECAY,
) -> LossParts:
    """The DSpark mix; without a confidence head the BCE term is left out."""
    w = position_weights(logits.shape[1], decay, logits.device)
    p_d = torch.softmax(logits.float(), -1)
    p_t = torch.softmax(target_logits.float(), -1).detach()
    ce = weighted_mean(token_ce(logits, labels), w, valid)
    l1 = weighted_mean(l1_distance(p_d, p_t), w, valid)
    total = CE_WEIGHT * ce + L1_WEIGHT * l1
    bce_value = 0.0
    if conf_logits is not None:
        label = confidence_label(p_d, p_t)
        bce = weighted_mean(F.binary_cross_entropy_with_logits(conf_logits.float(), label, reduction="none"), w, valid)
        total = total + BCE_WEIGHT * bce
        bce_value = bce.item()
    return LossParts(total=total, ce=ce.item(), l1=l1.item(), bce=bce_value)


def dflash_loss(logits: Tensor, labels: Tensor, valid: Tensor, decay: float = POSITION_DECAY) -> LossParts:
    """DeepSpec's DFlash baseline: the position-weighted CE alone. logits: [N, γ, V]; labels, valid: [N, γ]."""
    ce = weighted_mean(token_ce(logits, labels), position_weights(logits.shape[1], decay, logits.device), valid)
    return LossParts(total=ce, ce=ce.item())


def eagle3_loss(logits: Tensor, labels: Tensor, valid: Tensor, decay: float = EAGLE_STEP_DECAY) -> LossParts:
    """EAGLE-3 training-time test: CE at every unrolled step, step k weighted decay^(k−1).
    logits: [N, steps, V] from ttt_logits; labels, valid: [N, steps]."""
    ce = weighted_mean(token_ce(logits, labels), step_weights(logits.shape[1], decay, logits.device), valid)
    return LossParts(total=ce, ce=ce.item())

