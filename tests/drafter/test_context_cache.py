"""DraftContext: a drafter's context K/V grown chunk by chunk (as serving does, one accepted run of
tokens at a time, across several capacity doublings) drafts exactly what the stateless draft over all
features drafts."""
import pytest
import torch

from specd.drafter.context_cache import MIN_CAPACITY, DraftContext, append_many
from specd.sampling_params import SamplingParams

GREEDY = SamplingParams(temperature=0.0)
SAMPLED = SamplingParams(temperature=0.9, top_k=50)


def test_append_grows_and_keeps_what_was_there():
    c = DraftContext(2, 1, 4, torch.float32, torch.device("cpu"))
    chunks = [torch.randn(n, 1, 4) for n in (5, MIN_CAPACITY, 3 * MIN_CAPACITY)]
    for x in chunks:
        c.append([(x, -x), (2 * x, x)])
    want = torch.cat(chunks)
    k0, v0 = c.layer(0)
    k1, _ = c.layer(1)
    assert c.n == want.shape[0]
    assert torch.equal(k0, want) and torch.equal(v0, -want) and torch.equal(k1, 2 * want)


def test_append_many_fills_each_context_with_its_own_chunks():
    """Several contexts, two layers, chunks that cross capacity doublings (and a context given nothing new
    in a round): each context holds exactly the concatenation of its own chunks, layer by layer."""
    g = torch.Generator().manual_seed(0)
    contexts = [DraftContext(2, 2, 4, torch.float32, torch.device("cpu")) for _ in range(3)]
    held = [[([], []) for _ in range(2)] for _ in range(3)]            # context -> layer -> (ks, vs)
    for sizes in ((5, 1, 0), (MIN_CAPACITY, 3, 7), (2, 2 * MIN_CAPACITY, 1), (0, 0, 3 * MIN_CAPACITY)):
        chunks = [[(torch.randn(m, 2, 4, generator=g), torch.randn(m, 2, 4, generator=g)) for _ in range(2)]
                  for m in sizes]
        append_many(contexts, chunks)
        for i, per_layer in enumerate(chunks):
            for layer, (k, v) in enumerate(per_layer):
                held[i][layer][0].append(k)
                held[i][layer][1].append(v)
    for c, layers in zip(contexts, held):
        for layer, (ks, vs) in enumerate(layers):
            k, v = c.layer(layer)
            assert torch.equal(k, torch.cat(ks)) and torch.equal(v, torch.cat(vs))


@pytest.mark.parametrize("method", ["dspark", "eagle3"])
def test_incremental_context_drafts_like_the_stateless_draft(method, target, tokens, make_drafter, fused):
    drafter = make_drafter(target[0], method, gamma=5)
    feats = fused(drafter, target[0], tokens)
    n = len(tokens) - 1
    for params in (GREEDY, SAMPLED):
        want = drafter.draft([feats[:n]], [int(tokens[n])], [params], [torch.Generator().manual_seed(3)],
                             ctx_tokens=[tokens[:n]])
        ctx, tail, start = drafter.new_context(), feats[:0], 0
        for stop in [s for s in (1, 2, 9, 20) if s < n] + [n]:   # features arrive in runs, as tokens get accepted
            pending = torch.cat([tail, feats[start:stop]])
            first = stop - len(pending)
            tail = drafter.absorb(ctx, pending, tokens[first + 1: stop + 1])
            start = stop
        got = drafter.draft_contexts([ctx], [tail], [int(tokens[n])], [params], [torch.Generator().manual_seed(3)])
        assert torch.equal(got.tokens, want.tokens)
        torch.testing.assert_close(got.probs, want.probs, rtol=1e-5, atol=1e-6)
        if want.confidence is not None:
            torch.testing.assert_close(got.confidence, want.confidence, rtol=1e-5, atol=1e-6)


def test_batched_absorb_fills_each_context_like_absorbing_it_alone(target, tokens, make_drafter, fused):
    """absorb_many: one projection for several requests, each with its own length and start position
    (one starts empty, one already holds positions); every context ends up as if absorbed alone."""
    drafter = make_drafter(target[0], "dspark", gamma=5)
    feats = fused(drafter, target[0], tokens)
    runs = [(0, 7), (3, 4), (5, 5)]                       # (positions already held, new features)
    alone, batched = [], []
    for held, m in runs:
        a, b = drafter.new_context(), drafter.new_context()
        if held:
            drafter.absorb(a, feats[:held])
            drafter.absorb(b, feats[:held])
        alone.append(a)
        batched.append(b)
        drafter.absorb(a, feats[held:held + m])
    rest = drafter.absorb_many(batched, [feats[held:held + m] for held, m in runs])
    assert [r.shape[0] for r in rest] == [0, 0, 0]
    for a, b in zip(alone, batched):
        assert a.n == b.n
        for layer in range(a.num_layers):
            for x, y in zip(a.layer(layer), b.layer(layer)):
                torch.testing.assert_close(x, y, rtol=1e-5, atol=1e-6)
