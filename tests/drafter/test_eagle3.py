"""Eagle3Drafter: TTT shapes and masks, TTT == inference unroll, batched draft == single calls."""
import pytest
import torch

from specd.drafter import DrafterError
from specd.sampling_params import SamplingParams

GREEDY = SamplingParams(temperature=0.0)


@pytest.fixture(scope="module")
def eagle(target, make_drafter):
    return make_drafter(target[0], "eagle3", gamma=5)


@pytest.fixture(scope="module")
def feats(eagle, target, tokens, fused):
    return fused(eagle, target[0], tokens)


def test_ttt_shapes_and_gradients_through_the_unroll(eagle, feats, tokens):
    eagle.train()
    try:
        logits = eagle.ttt_logits(feats, tokens, torch.tensor([1, 6, 20]), steps=4)
        assert logits.shape == (3, 4, 512) and logits.dtype == torch.float32
        logits[:, 3].logsumexp(-1).sum().backward()           # only the last step's loss
        assert eagle.fc.weight.grad is None                    # feats were precomputed (no grad)
        assert eagle.layers[0].self_attn.q_proj.weight.grad.abs().sum() > 0
    finally:
        eagle.zero_grad(set_to_none=True)
        eagle.eval()


def test_ttt_never_sees_features_at_or_after_the_anchor(eagle, feats, tokens):
    anchors = torch.tensor([9, 14])
    with torch.no_grad():
        ref = eagle.ttt_logits(feats, tokens, anchors, steps=3)
        later = feats.clone()
        later[9:] += torch.randn_like(later[9:])
        out = eagle.ttt_logits(later, tokens, anchors, steps=3)
        earlier = feats.clone()
        earlier[7] += 1.0
        moved = eagle.ttt_logits(earlier, tokens, anchors, steps=3)
    torch.testing.assert_close(out[0], ref[0], rtol=0, atol=0)
    assert (moved[0] - ref[0]).abs().max() > 1e-3


def test_batched_ttt_equals_the_unroll_of_each_sequence(eagle, feats, tokens):
    """``ttt_logits_batch`` (training's path since session 42) gives ``ttt_logits`` of each sequence, rows
    in order: ragged lengths (one sequence the full text, others cut and shifted), different anchor counts,
    the first and last anchors an unroll allows. The masks are the point: a padded context position, or
    one at or after an anchor, would change the logits."""
    steps = 3
    cuts = [(0, tokens.shape[0]), (4, 19), (2, 11)]
    seqs = [(feats[a:b], tokens[a:b]) for a, b in cuts]
    anchors = [torch.tensor([1, 9, tokens.shape[0] - steps]), torch.tensor([15 - steps, 2]), torch.tensor([6])]
    with torch.no_grad():
        want = torch.cat([eagle.ttt_logits(f, t, a, steps) for (f, t), a in zip(seqs, anchors)])
        got = eagle.ttt_logits_batch([f for f, _ in seqs], [t for _, t in seqs], anchors, steps)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    for bad in (torch.tensor([0]), torch.tensor([15 - steps + 1]), torch.empty(0, dtype=torch.int64)):
        with pytest.raises(DrafterError, match="anchors"):
            eagle.ttt_logits_batch([f for f, _ in seqs[1:2]], [t for _, t in seqs[1:2]], [bad], steps)


def test_ttt_with_drafted_tokens_reproduces_the_greedy_draft(eagle, feats, tokens):
    """TTT teacher-forces the tokens; feeding it the draft's own tokens must give the draft's choices."""
    a, steps = 11, eagle.config.gamma
    out = eagle.draft([feats[:a]], [int(tokens[a])], [GREEDY], [None], ctx_tokens=[tokens[:a]])
    seq = torch.cat([tokens[:a + 1], out.tokens[0, :-1]])                       # T = a + steps
    padded = torch.cat([feats[:a], torch.randn(steps, feats.shape[1])])         # unseen positions: noise
    with torch.no_grad():
        logits = eagle.ttt_logits(padded, seq, torch.tensor([a]), steps=steps)
    assert torch.equal(logits[0].argmax(-1), out.tokens[0])


def test_batched_draft_equals_single_calls(eagle, feats, tokens):
    lens = [1, 12, 6]
    params = [SamplingParams(temperature=0.8, top_k=40), GREEDY, SamplingParams(temperature=1.0)]
    gens = lambda: [torch.Generator().manual_seed(11 + i) for i in range(3)]   # noqa: E731
    args = ([feats[:n] for n in lens], [int(tokens[n]) for n in lens])
    batched = eagle.draft(*args, params, gens(), ctx_tokens=[tokens[:n] for n in lens])
    assert batched.confidence is None and batched.lengths.tolist() == [5, 5, 5]
    for i, g in enumerate(gens()):
        single = eagle.draft([args[0][i]], [args[1][i]], [params[i]], [g], ctx_tokens=[tokens[:lens[i]]])
        assert torch.equal(single.tokens[0], batched.tokens[i])
        torch.testing.assert_close(single.probs[0], batched.probs[i], rtol=1e-5, atol=1e-6)


def test_draft_needs_context_tokens(eagle, feats, tokens):
    with pytest.raises(DrafterError):
        eagle.draft([feats[:4]], [int(tokens[4])], [GREEDY], [None])
    with pytest.raises(DrafterError):
        eagle.ttt_logits(feats, tokens, torch.tensor([0]), steps=2)


def test_absorb_pairs_equals_absorb_per_request(eagle):
    """One batched projection for several requests (``absorb_pairs``) leaves every context with the keys
    ``absorb`` would have written, to rounding (BLAS may round a row differently at another row count),
    and the same kept-back features; a request with one feature or none absorbs nothing. A token moved by
    one position changes the keys by far more than rounding."""
    g = torch.Generator().manual_seed(3)
    d, vocab = eagle.config.hidden_size, eagle.config.vocab_size
    sizes = [5, 1, 0, 9]
    feats = [torch.randn(m, d, generator=g) for m in sizes]
    after = [torch.randint(0, vocab, (m,), generator=g) for m in sizes]
    one, many = [eagle.new_context() for _ in sizes], [eagle.new_context() for _ in sizes]
    for c in one + many:                                   # contexts that already hold elements
        eagle.absorb(c, torch.randn(4, d, generator=torch.Generator().manual_seed(9)), torch.arange(4))
    with torch.no_grad():
        want = [eagle.absorb(c, f, t) for c, f, t in zip(one, feats, after)]
        got = eagle.absorb_pairs(many, feats, after)
        shifted = [eagle.new_context()]
        eagle.absorb(shifted[0], torch.randn(4, d, generator=torch.Generator().manual_seed(9)), torch.arange(4))
        eagle.absorb_pairs(shifted, [feats[0]], [after[0].roll(1)])
    assert [c.n for c in many] == [c.n for c in one] == [3 + 4, 3, 3, 3 + 8]
    for a, b in zip(got, want):
        assert torch.equal(a, b)
    for a, b in zip(many, one):
        for x, y in zip(a.layer(0), b.layer(0)):
            torch.testing.assert_close(x, y, rtol=0, atol=1e-5)
    assert (shifted[0].layer(0)[0] - one[0].layer(0)[0]).abs().max() > 1e-2
    with pytest.raises(DrafterError, match="one next token per feature"):
        eagle.absorb_pairs(many[:1], feats[:1], [after[0][:2]])
