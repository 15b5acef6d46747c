"""STS: sequential temperature scaling of the confidence head, and the ECE it minimises.

The scheduler (DESIGN.md §5) admits draft position j of a request by its survival ``a_j = Π_{i≤j} c_i``,
so what must be calibrated is the *cumulative* product, not each conditional c_i alone. STS gives every
block position its own temperature ``t_j`` on the confidence logit (``c_j = σ(z_j / t_j)``) and fits them
left to right: ``t_1`` by the ECE of ``a_1`` against the observed survival of position 1, then ``t_2`` with
``t_1`` fixed, and so on, each by a 1-D grid search. Temperatures > 1 soften an overconfident head.

Data: per verified block, the raw confidence logits ``z [M, γ]`` and the number of accepted drafts
``accepted [M]``; position j (1-based) survived iff ``accepted ≥ j``.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

ECE_BINS = 15
# log-spaced 0.25 .. 8: wide enough for heads that are 4x too sharp or too flat, 97 points
DEFAULT_GRID = tuple(float(t) for t in torch.logspace(-2, 3, 97, base=2.0))


class CalibrationError(ValueError):
    """Calibration data with the wrong shape, or too few blocks to fit."""


@dataclass(frozen=True)
class StsFit:
    temperatures: list[float]     # [γ], position j's temperature
    ece_before: float             # pooled ECE of the raw cumulative survival, all positions
    ece_after: float              # the same with the fitted temperatures
    ece_before_by_position: list[float]
    ece_after_by_position: list[float]


def ece(pred: Tensor, observed: Tensor, bins: int = ECE_BINS) -> float:
    """Expected calibration error: Σ_b (n_b / n) · |mean(pred_b) − mean(observed_b)| over equal-width bins.

    pred: [M] probabilities in [0, 1]; observed: [M] outcomes in {0, 1} (or frequencies). 0 for no data.
    """
    pred, observed = pred.flatten().double(), observed.flatten().double()
    if pred.numel() == 0:
        return 0.0
    idx = (pred * bins).long().clamp(0, bins - 1)
    count = torch.zeros(bins, dtype=torch.float64).index_add_(0, idx, torch.ones_like(pred))
    gap = torch.zeros(bins, dtype=torch.float64).index_add_(0, idx, pred - observed)
    return float(gap.abs().sum() / pred.numel())


def survival(accepted: Tensor, gamma: int) -> Tensor:
    """accepted: [M] int -> [M, γ] float, 1 where position j (1-based) survived (accepted ≥ j)."""
    return (torch.arange(1, gamma + 1).unsqueeze(0) <= accepted.long().unsqueeze(1)).float()


def cumulative_survival(conf_logits: Tensor, temperatures: Tensor) -> Tensor:
    """conf_logits: [M, γ]; temperatures: [γ] -> [M, γ] predicted a_j = Π_{i≤j} σ(z_i / t_i)."""
    return torch.cumprod(torch.sigmoid(conf_logits.double() / temperatures.double()), dim=1)


def apply_temperatures(confidence: Tensor, temperatures: Tensor) -> Tensor:
    """confidence: [.., γ] raw conditional probabilities -> calibrated ones, σ(logit(c) / t)."""
    c = confidence.double().clamp(1e-7, 1 - 1e-7)
    return torch.sigmoid(torch.logit(c) / temperatures.double()).to(confidence.dtype)


def ece_by_position(conf_logits: Tensor, accepted: Tensor, temperatures: Tensor) -> tuple[float, list[float]]:
    """(pooled ECE over all (block, position) pairs, per-position ECE) of the cumulative survival."""
    pred = cumulative_survival(conf_logits, temperatures)
    obs = survival(accepted, conf_logits.shape[1])
    per = [ece(pred[:, j], obs[:, j]) for j in range(pred.shape[1])]
    return ece(pred, obs), per


def fit_sts(conf_logits: Tensor, accepted: Tensor, grid: tuple[float, ...] = DEFAULT_GRID) -> StsFit:
    """conf_logits: [M, γ] raw confidence logits; accepted: [M] accepted drafts per block.

    Left to right, t_j = argmin over the grid of ECE(a_j, survived_j) with t_{<j} fixed (ties: the
    temperature closest to 1, so an already calibrated position is left alone)."""
    if conf_logits.dim() != 2 or accepted.shape != conf_logits.shape[:1]:
        raise CalibrationError(f"need conf_logits [M, γ] and accepted [M], "
                               f"got {tuple(conf_logits.shape)}, {tuple(accepted.shape)}")
    if conf_logits.shape[0] < 2:
        raise CalibrationError("STS needs at least 2 verified blocks")
    gamma = conf_logits.shape[1]
    obs = survival(accepted, gamma)
    ordered = sorted(grid, key=lambda t: abs(torch.log(torch.tensor(t)).item()))
    temps = torch.ones(gamma, dtype=torch.float64)
    prefix = torch.ones(conf_logits.shape[0], dtype=torch.float64)
    for j in range(gamma):
        z = conf_logits[:, j].double()
        scores = [ece(prefix * torch.sigmoid(z / t), obs[:, j]) for t in ordered]
        temps[j] = ordered[min(range(len(ordered)), key=scores.__getitem__)]
        prefix = prefix * torch.sigmoid(z / temps[j])
    before, before_pos = ece_by_position(conf_logits, accepted, torch.ones(gamma))
    after, after_pos = ece_by_position(conf_logits, accepted, temps)
    return StsFit(temps.tolist(), before, after, before_pos, after_pos)


@torch.no_grad()
def heldout_survival(target, drafter, seqs, temperature: float, seed: int, max_blocks_per_seq: int = 32
                     ) -> tuple[Tensor, Tensor]:
    """Observed survival of teacher-forced blocks on held-out sequences: (conf_logits [M, γ], accepted [M]).

    For each full block (anchor in the answer, all γ labels present) the drafter's Markov-corrected
    distribution at `temperature` proposes one token per slot (greedy: argmax, one-hot), and
    kernels.rejection_sample checks it against the target's distribution at the same temperature. The
    prefix of slot k is the data's token (teacher forcing), so a slot's outcome is exact given that
    prefix; a live chain would condition on the accepted drafts instead (identical at T = 0 when the data
    is greedy). Cheap and batched: no generation loop.
    """
    from kvspec_kernels.rejection_sample import rejection_sample
    from specd.drafter.train import make_blocks, sample_anchors, target_pass
    from specd.engine.sampler import inverse_cdf

    gamma = drafter.config.gamma
    gen = torch.Generator().manual_seed(seed)
    conf, accepted = [], []
    for s in seqs:
        n_full = len(s.tokens) - gamma - max(s.prompt_len - 1, 0)
        if n_full <= 0:
            continue
        logits, feats = target_pass(target, [s.tokens], drafter.config.target_layers)
        tok = torch.tensor(s.tokens, dtype=torch.int64, device=logits[0].device)
        anchors = sample_anchors(s.prompt_len, len(s.tokens) - gamma + 1, max_blocks_per_seq, gen).to(tok.device)
        b = make_blocks(tok, logits[0], anchors, gamma)
        out = drafter.block_logits(drafter.fuse(feats[0]), tok, anchors)
        d_logits = drafter.markov_logits(out.base_logits, b.prev)                      # [N, γ, V]
        t_logits = torch.cat([b.target_logits, b.target_logits[:, -1:]], dim=1)     # bonus row unused
        d_probs, t_probs = (_probs(x, temperature) for x in (d_logits, t_logits))
        n = anchors.numel()
        if temperature == 0:
            d_tok = d_logits.argmax(-1)
        else:
            u = torch.rand(n * gamma, generator=gen).to(tok.device)
            d_tok = inverse_cdf(d_probs.flatten(0, 1), u).view(n, gamma)
        acc, _ = rejection_sample(t_probs.contiguous(), d_probs.contiguous(), d_tok,
                                  torch.full((n,), gamma, dtype=torch.int32, device=tok.device),
                                  torch.rand(n, gamma, generator=gen).to(tok.device),
                                  torch.rand(n, generator=gen).to(tok.device))
        conf.append(drafter.confidence_logits(out.hidden, b.prev).float().cpu())
        accepted.append(acc.long().cpu())
    if not conf:
        raise CalibrationError("no held-out sequence is long enough for a full block")
    return torch.cat(conf), torch.cat(accepted)


def _probs(logits: Tensor, temperature: float) -> Tensor:
    """logits: [N, K, V] -> fp32 [N, K, V], what serving samples from at `temperature` (one-hot when 0)."""
    from specd.engine.speculation import target_probs
    from specd.sampling_params import SamplingParams

    flat = target_probs(logits.flatten(0, 1).float(), SamplingParams(temperature=temperature))
    return flat.view(logits.shape)
