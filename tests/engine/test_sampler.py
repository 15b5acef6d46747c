import pytest
import torch

from specd.drafter.base import SlotSampler
from specd.engine.sampler import RowKinds, inverse_cdf, sample, sampling_probs
from kvspec_kernels.nucleus import bucket_nucleus_probs_ref
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


# -- fast paths against the reference (the full-sort implementation sampling_probs had before) ----------



def reference_probs(logits, temperature, top_k, top_p):
    """The former single path: sort the whole vocabulary for every row, whatever its settings."""
    logits = logits.float() / temperature.unsqueeze(1)
    vocab = logits.shape[1]
    sorted_logits, order = torch.sort(logits, dim=1, descending=True)
    rank = torch.arange(vocab).unsqueeze(0)
    k = torch.where(top_k > 0, top_k.clamp(max=vocab), torch.full_like(top_k, vocab)).unsqueeze(1)
    drop = rank >= k
    sorted_probs = torch.softmax(sorted_logits.masked_fill(drop, float("-inf")), dim=1)
    drop |= torch.cumsum(sorted_probs, dim=1) - sorted_probs >= top_p.unsqueeze(1)
    probs_sorted = torch.softmax(sorted_logits.masked_fill(drop, float("-inf")), dim=1)
    return torch.zeros_like(probs_sorted).scatter_(1, order, probs_sorted)


def settings(top_k, top_p):
    n = len(top_k)
    return torch.rand(n) + 0.3, torch.tensor(top_k), torch.tensor(top_p, dtype=torch.float32)



@pytest.mark.parametrize("vocab", [512, 151_936])
@pytest.mark.parametrize("top_k, top_p", [([20, 1, 5, 50, 20, 3, 7, 100], [1.0, 1, 1, 1, .9, .5, .95, .8]),
                                          ([0] * 8, [.9, .5, .99, .1, .9, .7, .3, .95])], ids=["top-k", "top-p"])
def test_filtered_rows_equal_the_reference(vocab, top_k, top_p):
    """Top-k rows: bit for bit. Top-p rows without top-k go through kernels.nucleus (session 11): the
    same nucleus, its weights normalised as exp(l - max) / Σ kept instead of a second softmax, so equal
    up to rounding."""
    torch.manual_seed(vocab)
    logits = torch.randn(8, vocab) * 3
    t, k, p = settings(top_k, top_p)
    new, ref = sampling_probs(logits, t, k, p), reference_probs(logits, t, k, p)
    if top_k[0]:
        assert torch.equal(new, ref)
    else:
        assert_same_nucleus(new, ref, logits, t, p)


def assert_same_nucleus(new, ref, logits, temperature, top_p, boundary_tol=1e-4, rtol=1e-4):
    """The same nucleus up to the tokens at its boundary, which fp32 rounding decides: a token kept by one
    and dropped by the other must have, in exact (float64) arithmetic, a mass before it within
    ``boundary_tol`` of top_p. Why that and not a count: the fp32 softmax over a 152k vocabulary carries a
    relative error of ~1e-5 into every probability, so the running sum at the boundary moves by ~2-3e-5
    (session 61, an AMD EPYC host: a 417-token nucleus whose 418th token, 4.1e-4 of mass, sits 2.4e-5 from
    top_p; before, 76,684 kept tokens against 76,686). A wrong rule (a token past the boundary kept, a
    nucleus cut short) puts a differing token far from top_p. On the tokens both keep, the two agree once
    each is renormalised over them (a boundary token of 4.1e-4 moves every other one by that much)."""
    exact = torch.softmax(logits.double() / temperature.double().unsqueeze(1), dim=1)
    sorted_exact, order = exact.sort(dim=1, descending=True)
    before = torch.zeros_like(exact).scatter_(1, order, torch.cumsum(sorted_exact, dim=1) - sorted_exact)
    differ = (new > 0) != (ref > 0)
    distance = (before - top_p.double().unsqueeze(1)).abs()
    assert (distance[differ] < boundary_tol).all(), distance[differ].max()
    both = (new > 0) & (ref > 0)
    common_new, common_ref = (torch.where(both, x, 0.0) for x in (new, ref))
    common_new, common_ref = (x / x.sum(1, keepdim=True) for x in (common_new, common_ref))
    assert torch.allclose(common_new[both], common_ref[both], rtol=rtol, atol=0.0)


@pytest.mark.parametrize("vocab", [512, 151_936])
def test_unfiltered_rows_are_the_softmax_and_differ_from_the_reference_only_in_its_rounded_off_tail(vocab):
    """No top-k, top-p = 1: one softmax. The reference summed the sorted probabilities in fp32; the sum
    reaches 1.0 before the end of a 152k vocabulary, so it also dropped a tail (up to ~1e-4 of the mass):
    a rounding artefact, not the requested distribution. Both sides of verification use the new one."""
    torch.manual_seed(vocab)
    logits = torch.randn(8, vocab) * 3
    t, k, p = settings([0] * 8, [1.0] * 8)
    new, ref = sampling_probs(logits, t, k, p), reference_probs(logits, t, k, p)
    assert torch.equal(new, torch.softmax(logits / t.unsqueeze(1), dim=1))
    kept = ref > 0
    assert (torch.where(kept, 0.0, new).sum(1) < 1e-4).all()            # the tail the reference dropped
    assert ((new - ref).abs()[kept] / new[kept]).max() < 2e-4            # renormalised by that mass only
    probs_kept = torch.where(kept, new, 0.0)
    assert torch.allclose(probs_kept / probs_kept.sum(1, keepdim=True), ref, rtol=1e-5, atol=1e-12)


def test_a_rows_probabilities_do_not_depend_on_its_batch():
    torch.manual_seed(3)
    logits = torch.randn(6, 300) * 2
    t, k, p = settings([0, 20, 0, 0, 5, 0], [1.0, 0.9, 0.8, 1.0, 1.0, 0.95])
    mixed = sampling_probs(logits, t, k, p)
    for i in range(6):
        alone = sampling_probs(logits[i:i + 1], t[i:i + 1], k[i:i + 1], p[i:i + 1])
        assert torch.equal(mixed[i], alone[0])
    assert torch.equal(mixed, sampling_probs(logits, t, k, p, RowKinds.of(k.tolist(), p.tolist(), 300)))


def reference_slot(params, generators, gamma, logits, slot):
    """The former SlotSampler: every row through the full sort, greedy rows replaced by a one-hot."""
    greedy = torch.tensor([q.greedy for q in params])
    t = torch.tensor([q.temperature if not q.greedy else 1.0 for q in params])
    u = torch.zeros(len(params), gamma)
    rows = [i for i, q in enumerate(params) if not q.greedy]
    if rows:
        u[rows] = torch.stack([torch.rand(gamma, generator=generators[i]) for i in rows])
    top_p = torch.tensor([q.top_p for q in params], dtype=torch.float32)
    probs = reference_probs(logits, t, torch.tensor([q.top_k for q in params]), top_p)
    # a draft's top-p rows without top-k take the rounded nucleus (kernels.nucleus, session 11)
    nucleus = torch.tensor([not q.greedy and q.top_k == 0 and q.top_p < 1.0 for q in params])
    probs = torch.where(nucleus[:, None], bucket_nucleus_probs_ref(logits / t[:, None], top_p), probs)
    sampled = inverse_cdf(probs, u[:, slot])
    argmax = logits.argmax(1)
    one_hot = torch.zeros_like(probs).scatter_(1, argmax[:, None], 1.0)
    return torch.where(greedy, argmax, sampled), torch.where(greedy[:, None], one_hot, probs)


@pytest.mark.parametrize("kinds", ["greedy", "sampled", "mixed"])
def test_slot_sampler_fast_paths_equal_the_reference(kinds):
    greedy = SamplingParams(temperature=0.0)
    hot = SamplingParams(temperature=0.7, top_k=20, top_p=0.9)
    nucleus = SamplingParams(temperature=1.2, top_p=0.8)
    params = {"greedy": [greedy] * 4, "sampled": [hot, nucleus, hot, nucleus],
              "mixed": [greedy, hot, greedy, nucleus]}[kinds]
    torch.manual_seed(11)
    logits = torch.randn(4, 1000) * 2
    new = SlotSampler(params, [torch.Generator().manual_seed(i) for i in range(4)], 3, torch.device("cpu"))
    for slot in range(3):
        tokens, probs = new(logits, slot)
        want_tokens, want_probs = reference_slot(params, [torch.Generator().manual_seed(i) for i in range(4)], 3,
                                                 logits, slot)
        assert torch.equal(tokens, want_tokens) and torch.equal(probs, want_probs)


def test_a_plan_made_before_the_forward_samples_exactly_what_sampling_after_it_does():
    """``SamplePlan`` (made before a step's forward, the logits rows chosen by index) and ``sample`` on the
    gathered rows (made after it) give the same tokens from the same generator states, for greedy,
    top-p, top-k and plain rows mixed; each sampled row draws one uniform from its own generator, the
    greedy row none."""
    from specd.engine.sampler import SamplePlan, sample_planned

    torch.manual_seed(0)
    logits = torch.randn(6, 64)
    rows = [4, 0, 5, 2]                                  # the step's sampling rows, out of order
    params = [SamplingParams(temperature=0.0), SamplingParams(temperature=0.8, top_p=0.9, seed=1),
              SamplingParams(temperature=1.2, top_k=5, seed=2), SamplingParams(temperature=0.7, seed=3)]
    for trial in range(20):
        gens_a = [None] + [torch.Generator().manual_seed(100 * trial + i) for i in range(3)]
        gens_b = [None] + [torch.Generator().manual_seed(100 * trial + i) for i in range(3)]
        plan = SamplePlan.of(rows, params, gens_a, logits.shape[1], logits.device)
        got = sample_planned(logits, plan)
        assert torch.equal(got, sample(logits[rows], params, [None] + [torch.Generator().manual_seed(
            100 * trial + i) for i in range(3)])) and got.dtype == torch.int64
        want = [int(logits[4].argmax())]                 # row by row from the definitions
        for r, p, g in zip(rows[1:], params[1:], gens_b[1:]):
            probs = sampling_probs(logits[r: r + 1], torch.tensor([p.temperature]), torch.tensor([p.top_k]),
                                   torch.tensor([p.top_p]))
            want.append(int(inverse_cdf(probs, torch.rand(1, generator=g))[0]))
        assert got.tolist() == want
        for a, b in zip(gens_a[1:], gens_b[1:]):       # one draw each, in both
            assert torch.equal(torch.rand(1, generator=a), torch.rand(1, generator=b))
    every = SamplePlan.of([1, 3], params[1:3], [None, None], logits.shape[1], logits.device)
    assert every.every_row_samples and every.settings.sampled == (0, 1)    # every row samples: no gather
    greedy = SamplePlan.of([1], params[:1], [None], logits.shape[1], logits.device)
    assert not greedy.every_row_samples and greedy.settings.sampled == () and torch.equal(sample_planned(logits, greedy), logits[[1]].argmax(1))


def test_static_probs_refuses_a_path_without_sampled_rows():
    """A greedy-only slot is kvspec_kernels/markov_slot.plain_slot's (an argmax and a one-hot); static_probs
    has no transform to run for it and says so rather than return nothing."""
    from specd.engine.sampler import GREEDY_ROW, SamplingPath, static_probs

    logits, rows = torch.zeros(2, 5), torch.full((2,), GREEDY_ROW)
    with pytest.raises(ValueError, match="sampled rows"):
        static_probs(logits, torch.zeros(2, dtype=torch.int64), torch.ones(2), rows, SamplingPath(greedy=True))
