import torch

from specd.engine.sampler import inverse_cdf, sample, sampling_probs
from specd.sampling_params import SamplingParams


def test_sampling_probs_filters_top_k_and_top_p():
    torch.manual_seed(0)
    logits = torch.randn(3, 50)
    p = sampling_probs(logits, torch.tensor([1.0, 0.5, 1.0]), torch.tensor([0, 5, 0]), torch.tensor([1.0, 1.0, 0.3]))
    assert torch.allclose(p.sum(1), torch.ones(3))
    assert torch.allclose(p[0], torch.softmax(logits[0], 0), atol=1e-6)
    assert (p[1] > 0).sum() == 5
    assert set(p[1].nonzero().flatten().tolist()) == set(logits[1].topk(5).indices.tolist())
    kept = p[2] > 0
    full = torch.softmax(logits[2], 0)
    # the kept set is the smallest top set reaching 0.3 of the mass
    assert full[kept].sum() >= 0.3
    assert full[kept].sum() - full[kept].min() < 0.3


def test_greedy_rows_take_the_argmax():
    logits = torch.randn(4, 30)
    params = [SamplingParams(temperature=0.0)] * 4
    assert torch.equal(sample(logits, params, [None] * 4), logits.argmax(1))


def test_seeded_samples_are_reproducible_and_follow_the_distribution():
    logits = torch.log(torch.tensor([[0.1, 0.2, 0.7]]))
    params = [SamplingParams(temperature=1.0, seed=7)]
    a = [sample(logits, params, [torch.Generator().manual_seed(7)]).item() for _ in range(3)]
    b = [sample(logits, params, [torch.Generator().manual_seed(7)]).item() for _ in range(3)]
    assert a == b
    g = torch.Generator().manual_seed(1)
    draws = torch.tensor([sample(logits, params, [g]).item() for _ in range(3000)])
    freq = torch.bincount(draws, minlength=3).float() / 3000
    assert torch.allclose(freq, torch.tensor([0.1, 0.2, 0.7]), atol=0.03)


def test_inverse_cdf_never_picks_a_zero_probability_token():
    probs = torch.tensor([[0.0, 0.5, 0.0, 0.5]] * 5)
    u = torch.tensor([0.0, 0.25, 0.5, 0.75, 0.999999])
    assert set(inverse_cdf(probs, u).tolist()) <= {1, 3}
