"""BlockDrafter (DSpark / DFlash) on the stories260K target: masks, batching, exact probs, gradients."""
import pytest
import torch

from specd.drafter import BlockDrafter, DrafterError, target_features
from specd.engine.sampler import sampling_probs
from specd.sampling_params import SamplingParams

GREEDY = SamplingParams(temperature=0.0)
HOT = SamplingParams(temperature=0.9, top_k=50, top_p=0.95)


@pytest.fixture(scope="module")
def dspark(target, make_drafter):
    return make_drafter(target[0], "dspark")


@pytest.fixture(scope="module")
def ctx(dspark, target, tokens, fused):
    return fused(dspark, target[0], tokens)


def test_shapes_and_determinism(dspark, ctx, tokens):
    anchors = torch.tensor([0, 3, 10, len(tokens) - 1])
    with torch.no_grad():
        a = dspark.block_logits(ctx, tokens, anchors)
        b = dspark.block_logits(ctx, tokens, anchors)
    assert a.base_logits.shape == (4, 7, 512) and a.base_logits.dtype == torch.float32
    assert a.hidden.shape == (4, 7, 64)
    assert torch.equal(a.base_logits, b.base_logits)


def test_block_never_sees_context_at_or_after_its_anchor(dspark, ctx, tokens):
    anchor = 12
    with torch.no_grad():
        ref = dspark.block_logits(ctx, tokens, torch.tensor([anchor])).base_logits
        later = ctx.clone()
        later[anchor:] += torch.randn_like(later[anchor:])
        same = dspark.block_logits(later, tokens, torch.tensor([anchor])).base_logits
        earlier = ctx.clone()
        earlier[anchor - 1] += 1.0
        moved = dspark.block_logits(earlier, tokens, torch.tensor([anchor])).base_logits
    torch.testing.assert_close(same, ref, rtol=0, atol=0)
    assert (moved - ref).abs().max() > 1e-3


def test_attention_inside_the_block_is_bidirectional(dspark, ctx, tokens):
    g, a = dspark.config.gamma, 8
    ids = torch.full((1, g), dspark.config.mask_token_id)
    ids[0, 0] = tokens[a]
    positions = (a + torch.arange(g))[None]
    kv = dspark.context_kv(ctx[None], torch.arange(len(tokens))[None])
    sees_ctx = (torch.arange(len(tokens)) < a).expand(1, g, -1)
    mask = torch.cat([sees_ctx, torch.ones(1, g, g, dtype=torch.bool)], dim=2)
    with torch.no_grad():
        ref = dspark.block_hidden(ids, positions, kv, mask)
        ids[0, g - 1] = tokens[a + 3]                           # a *later* slot changes ...
        out = dspark.block_hidden(ids, positions, kv, mask)
    assert (out[0, 0] - ref[0, 0]).abs().max() > 1e-4         # ... and the first slot sees it


def test_blocks_in_one_batch_are_independent(dspark, ctx, tokens):
    anchors = torch.tensor([5, 15])
    with torch.no_grad():
        ref = dspark.block_logits(ctx, tokens, anchors).base_logits
        changed = tokens.clone()
        changed[5] = (changed[5] + 1) % 512                  # block A's anchor token
        out = dspark.block_logits(ctx, changed, anchors).base_logits
    torch.testing.assert_close(out[1], ref[1], rtol=0, atol=1e-6)
    assert (out[0] - ref[0]).abs().max() > 1e-3


def test_training_block_equals_inference_block(dspark, ctx, tokens):
    anchors = [4, 9, 20]
    with torch.no_grad():
        train = dspark.block_logits(ctx, tokens, torch.tensor(anchors))
        infer = dspark.draft_block(dspark.contexts_of([ctx[:a] for a in anchors]), [int(tokens[a]) for a in anchors])
    torch.testing.assert_close(infer.base_logits, train.base_logits, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(infer.hidden, train.hidden, rtol=1e-5, atol=1e-5)


def _gens(seed: int):
    return [torch.Generator().manual_seed(seed + i) for i in range(3)]


def test_batched_draft_equals_single_calls(dspark, ctx, tokens):
    lens, params = [3, 17, 9], [HOT, GREEDY, SamplingParams(temperature=1.3)]
    feats, last = [ctx[:n] for n in lens], [int(tokens[n]) for n in lens]
    batched = dspark.draft(feats, last, params, _gens(7))
    for i, g in enumerate(_gens(7)):
        single = dspark.draft([feats[i]], [last[i]], [params[i]], [g])
        assert torch.equal(single.tokens[0], batched.tokens[i])
        torch.testing.assert_close(single.probs[0], batched.probs[i], rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(single.confidence[0], batched.confidence[i], rtol=1e-5, atol=1e-6)


def test_greedy_probs_are_one_hot_at_the_markov_argmax(dspark, ctx, tokens):
    out = dspark.draft([ctx[:11]], [int(tokens[11])], [GREEDY], [None])
    base = dspark.draft_block(dspark.contexts_of([ctx[:11]]), [int(tokens[11])]).base_logits
    prev = torch.cat([tokens[11:12], out.tokens[0, :-1]])[None]
    corrected = dspark.markov_logits(base, prev)
    assert torch.equal(out.tokens, corrected.argmax(-1))
    assert torch.equal(out.probs, torch.nn.functional.one_hot(out.tokens, 512).float())
    # the Markov bias is not a no-op here: the base argmax differs somewhere
    assert not torch.equal(base.argmax(-1), corrected.argmax(-1))


def test_sampled_probs_are_exactly_the_sampling_distribution(dspark, ctx, tokens):
    lens = [6, 13, 2]
    params = [HOT, SamplingParams(temperature=0.7, top_k=5), SamplingParams(temperature=1.0, top_p=0.5)]
    feats, last = [ctx[:n] for n in lens], [int(tokens[n]) for n in lens]
    out = dspark.draft(feats, last, params, _gens(3))
    base = dspark.draft_block(dspark.contexts_of(feats), last).base_logits
    prev = torch.cat([torch.tensor(last)[:, None], out.tokens[:, :-1]], dim=1)
    corrected = dspark.markov_logits(base, prev)
    for i, p in enumerate(params):
        rows = corrected[i]
        want = sampling_probs(rows, torch.full((7,), p.temperature), torch.full((7,), p.top_k),
                              torch.full((7,), p.top_p), draft=True)     # a draft's distribution
        torch.testing.assert_close(out.probs[i], want, rtol=1e-5, atol=1e-7)
        assert (out.probs[i].gather(1, out.tokens[i][:, None]) > 0).all()
    assert (out.probs[1] > 0).sum(-1).max() <= 5               # top-k really filtered


def test_confidence_is_sigmoid_of_the_head_on_sampled_prev_tokens(dspark, ctx, tokens):
    out = dspark.draft([ctx[:9]], [int(tokens[9])], [HOT], [torch.Generator().manual_seed(1)])
    hidden = dspark.draft_block(dspark.contexts_of([ctx[:9]]), [int(tokens[9])]).hidden
    prev = torch.cat([tokens[9:10], out.tokens[0, :-1]])[None]
    with torch.no_grad():
        want = torch.sigmoid(dspark.confidence_logits(hidden, prev))
    assert out.confidence.shape == (1, 7) and out.confidence.dtype == torch.float32
    torch.testing.assert_close(out.confidence, want)


def test_markov_rank_zero_is_the_identity(target, tokens, make_drafter, fused):
    dflash = make_drafter(target[0], "dflash")
    ctx = fused(dflash, target[0], tokens)
    with torch.no_grad():
        block = dflash.block_logits(ctx, tokens, torch.tensor([3, 7]))
    prev = torch.randint(0, 512, (2, 7))
    assert torch.equal(dflash.markov_logits(block.base_logits, prev), block.base_logits)
    out = dflash.draft([ctx[:7]], [int(tokens[7])], [GREEDY], [None])
    assert torch.equal(out.tokens[0], block.base_logits[1].argmax(-1))
    assert out.confidence is None
    with pytest.raises(DrafterError):
        dflash.confidence_logits(block.hidden, prev)


def _captured(drafter, model, tokens):
    return target_features(model, tokens, drafter.config.target_layers).captured


def test_gradients_reach_the_drafter_but_not_the_target(target, tokens, make_drafter):
    model, _ = target
    drafter = make_drafter(model, "dspark").train()
    for p in model.parameters():
        p.requires_grad_(True)
    try:
        ctx = drafter.fuse(_captured(drafter, model, tokens))
        block = drafter.block_logits(ctx, tokens, torch.tensor([2, 8]))
        prev = torch.cat([tokens[[2, 8]][:, None], torch.stack([tokens[3:9], tokens[9:15]])], dim=1)
        loss = drafter.markov_logits(block.base_logits, prev).logsumexp(-1).mean()
        loss = loss + drafter.confidence_logits(block.hidden, prev).mean()
        loss.backward()
        assert drafter.fc.weight.grad is not None and drafter.fc.weight.grad.abs().sum() > 0
        assert drafter.markov_head.markov_w1.weight.grad.abs().sum() > 0
        assert drafter.confidence_head.proj.weight.grad.abs().sum() > 0
        assert model.embed_tokens.weight.grad is None and model.lm_head.weight.grad is None
        assert drafter.num_parameters() == drafter.num_parameters(trainable_only=True)
        assert drafter.num_parameters() < sum(p.numel() for p in model.parameters())
    finally:
        for p in model.parameters():
            p.requires_grad_(False)
            p.grad = None


def test_anchor_out_of_range_and_missing_target_raise(dspark, ctx, tokens):
    with pytest.raises(DrafterError):
        dspark.block_logits(ctx, tokens, torch.tensor([len(tokens)]))
    with pytest.raises(DrafterError):
        fresh = BlockDrafter(dspark.config)
        fresh.draft_block(fresh.contexts_of([ctx[:3]]), [1])
