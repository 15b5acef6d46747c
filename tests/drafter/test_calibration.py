"""STS and ECE: exact ECE values on hand-made data, and STS fixing a synthetic overconfident head."""
import math

import pytest
import torch

from specd.drafter.calibration import (CalibrationError, apply_temperatures, cumulative_survival, ece, fit_sts,
                                       survival)


def test_ece_known_values():
    # two bins: preds 0.9 (outcomes 1,1,0,0 -> mean .5, gap .4) and 0.1 (outcomes 0,0 -> gap .1)
    pred = torch.tensor([0.9, 0.9, 0.9, 0.9, 0.1, 0.1])
    obs = torch.tensor([1.0, 1.0, 0.0, 0.0, 0.0, 0.0])
    assert ece(pred, obs) == pytest.approx(4 / 6 * 0.4 + 2 / 6 * 0.1)
    assert ece(torch.tensor([0.25, 0.75]), torch.tensor([0.25, 0.75])) == 0.0


def test_survival_from_accepted_lengths():
    s = survival(torch.tensor([0, 2, 3]), 3)
    assert s.tolist() == [[0, 0, 0], [1, 1, 0], [1, 1, 1]]


def _synthetic(m: int = 4000, gamma: int = 4, sharpen: float = 3.0, seed: int = 0):
    """True conditional survival q ~ U(0.3, 0.95); the head reports logit(q) * sharpen (overconfident)."""
    g = torch.Generator().manual_seed(seed)
    q = 0.3 + 0.65 * torch.rand(m, gamma, generator=g)
    outcome = torch.rand(m, gamma, generator=g) < q
    accepted = torch.cumprod(outcome.long(), dim=1).sum(1)
    return torch.logit(q) * sharpen, accepted


def test_sts_reduces_ece_on_overconfident_head():
    logits, accepted = _synthetic()
    fit = fit_sts(logits, accepted)
    assert fit.ece_before > 0.05
    assert fit.ece_after < 0.03
    assert fit.ece_after < fit.ece_before / 3
    # the head is 3x too sharp: the fitted temperatures undo it (later positions see fewer
    # survivors, so their ECE minimum is flatter and their temperature looser)
    assert 2.5 < fit.temperatures[0] < 3.6, fit.temperatures
    assert all(2.0 < t < 6.0 for t in fit.temperatures), fit.temperatures
    # calibrated held-out data from the same process
    held_logits, held_acc = _synthetic(seed=1)
    pred = cumulative_survival(held_logits, torch.tensor(fit.temperatures))
    assert ece(pred, survival(held_acc, 4)) < 0.03


def test_sts_keeps_calibrated_head_near_one():
    logits, accepted = _synthetic(sharpen=1.0)
    fit = fit_sts(logits, accepted)
    assert fit.ece_after <= fit.ece_before + 1e-12
    assert 0.8 < fit.temperatures[0] < 1.25, fit.temperatures
    assert all(0.6 < t < 1.8 for t in fit.temperatures), fit.temperatures


def test_apply_temperatures_matches_logit_scaling():
    c = torch.tensor([[0.9, 0.5, 0.2]])
    t = torch.tensor([2.0, 3.0, 0.5])
    expected = torch.sigmoid(torch.logit(c.double()) / t.double())
    assert torch.allclose(apply_temperatures(c, t).double(), expected, atol=1e-6)
    assert apply_temperatures(c, t)[0, 1].item() == pytest.approx(0.5)
    assert math.isclose(apply_temperatures(c, t)[0, 0].item(), 1 / (1 + 9 ** -0.5), rel_tol=1e-5)


def test_fit_rejects_bad_shapes():
    with pytest.raises(CalibrationError):
        fit_sts(torch.zeros(5, 3), torch.zeros(4))
