"""EAGLE-3's captured draft (specd/engine/eagle3_graphs.py) against its eager reference
(Eagle3Drafter.draft_contexts).

CUDA graphs cannot be captured on the CPU, so ``Eagle3Graphs(replay_eagerly=True)`` runs the captured
function itself (``padded_draft``) on the same static buffers: padding rows, a padded context, stale
buffers of earlier batches, the packed settings and the uniforms drawn exactly as ``SlotSampler`` draws
them. Against the eager reference (padded only to the batch's longest context, unpadded batch) a row can
differ in rounding, so the tests compare probabilities to a tolerance and tokens exactly (on these random
weights no draw sits within rounding of a boundary; a planted bug moves tokens and probabilities by far
more)."""
from __future__ import annotations

import pytest
import torch

from specd.engine.eagle3_graphs import Eagle3GraphKey, Eagle3Graphs
from specd.engine.sampler import SamplingPath
from specd.sampling_params import SamplingParams
from tests.engine.test_block_graphs import make_drafter

CPU = torch.device("cpu")
PARAMS = [SamplingParams(temperature=0.0), SamplingParams(temperature=0.8, top_p=0.9),
          SamplingParams(temperature=1.0, top_k=20), SamplingParams(temperature=0.7)]


@pytest.fixture(scope="module")
def drafter():
    torch.set_num_threads(1)
    return make_drafter("cpu", "eagle3")


def requests(drafter, n: int, seed: int, longest: int = 300, device: str = "cpu"):
    """n requests with contexts of mixed lengths in [2, longest]: (contexts, tails, anchors)."""
    g = torch.Generator().manual_seed(seed)
    contexts, tails = [], []
    for m in torch.randint(2, longest + 1, (n,), generator=g).tolist():
        feats = torch.randn(m, drafter.config.hidden_size, generator=g).to(device)
        after = torch.randint(0, drafter.config.vocab_size, (m,), generator=g).to(device)
        c = drafter.new_context()
        tails.append(drafter.absorb(c, feats, after))
        contexts.append(c)
    anchors = torch.randint(0, drafter.config.vocab_size, (n,), generator=g).tolist()
    return contexts, tails, anchors


def gens(n: int, seed: int = 0):
    return [torch.Generator().manual_seed(seed + i) for i in range(n)]


def both(drafter, graphs, n: int, seed: int, params, longest: int = 300):
    """(graph draft, eager draft, the longest context) of one batch, each draft with fresh generators of
    the same seeds."""
    contexts, tails, anchors = requests(drafter, n, seed, longest)
    with torch.no_grad():
        got = drafter.draft_contexts(contexts, tails, anchors, params, gens(n), rounds=graphs)
        got = (got.tokens.clone(), got.probs.clone())
        want = drafter.draft_contexts(contexts, tails, anchors, params, gens(n))
    return got, (want.tokens, want.probs), max(c.n for c in contexts)


def test_static_draft_matches_the_eager_reference_through_batches(drafter):
    """One instance through batches of 16, 1, 3 and 16 (stale contexts and tails of the longer batches stay
    in the buffers), every row kind mixed: the same tokens, the same probabilities to rounding, greedy
    rows the argmax of theirs; each batch replayed its own key."""
    graphs = Eagle3Graphs(drafter, 16, 512, CPU, replay_eagerly=True)
    keys = []
    for n, seed in ((16, 0), (1, 1), (3, 2), (16, 3)):
        params = [PARAMS[i % len(PARAMS)] for i in range(n)]
        (tokens, probs), (want_tokens, want_probs), longest = both(drafter, graphs, n, seed, params,
                                                                   longest=300 if seed < 3 else 40)
        assert torch.equal(tokens, want_tokens), (n, seed)
        torch.testing.assert_close(probs, want_probs, rtol=0, atol=1e-5)
        for row in range(0, n, len(PARAMS)):                          # greedy rows
            assert torch.equal(tokens[row], probs[row].argmax(-1))
        keys.append(Eagle3GraphKey({16: 16, 1: 1, 3: 4}[n], 256 if longest <= 256 else 512,
                                   SamplingPath(greedy=True) if n == 1 else SamplingPath(True, n > 3, 20, True)))
    assert graphs.replays == 4 and graphs.eager_drafts == 0
    assert set(graphs.graphs) == set(keys) and len(keys) == 4


def test_a_planted_bug_in_the_static_draft_is_seen(drafter, monkeypatch):
    """The comparison can fail: a static draft that feeds each step the anchor instead of the token it
    drew (a wrong index in the loop) changes the tokens and probabilities of later steps."""
    from specd.drafter.eagle3 import Eagle3Drafter

    real_step = Eagle3Drafter.step
    calls = {"n": 0}

    def stale_token(self, hidden, tokens, positions, ctx, ctx_mask, own):
        calls["n"] += 1
        first = own[0][0] if own else None       # after the first step, feed the first token again
        return real_step(self, hidden, tokens if first is None else torch.zeros_like(tokens), positions, ctx,
                         ctx_mask, own)

    graphs = Eagle3Graphs(drafter, 4, 512, CPU, replay_eagerly=True)
    contexts, tails, anchors = requests(drafter, 3, seed=5)
    params = [SamplingParams(temperature=0.0)] * 3
    with torch.no_grad():
        want = drafter.draft_contexts(contexts, tails, anchors, params, gens(3))
        want = (want.tokens.clone(), want.probs.clone())
        monkeypatch.setattr(Eagle3Drafter, "step", stale_token)
        got = drafter.draft_contexts(contexts, tails, anchors, params, gens(3), rounds=graphs)
    assert calls["n"] == drafter.config.gamma
    assert not torch.equal(got.tokens, want[0]) and (got.probs - want[1]).abs().max() > 1e-2


def test_shapes_no_graph_holds_run_the_eager_reference(drafter):
    """A context past the engine's limit, and a batch past its batch, run ``draft_contexts`` eagerly:
    the same output as without graphs, counted."""
    graphs = Eagle3Graphs(drafter, 4, 256, CPU, replay_eagerly=True)
    params = [SamplingParams(temperature=0.0)] * 2
    contexts, tails, anchors = requests(drafter, 2, seed=6, longest=40)
    long_ctx, long_tail, _ = requests(drafter, 1, seed=7, longest=300)
    while long_ctx[0].n <= 256:
        long_ctx, long_tail, _ = requests(drafter, 1, seed=8 + long_ctx[0].n, longest=300)
    contexts[0], tails[0] = long_ctx[0], long_tail[0]
    with torch.no_grad():
        got = drafter.draft_contexts(contexts, tails, anchors, params, gens(2), rounds=graphs)
        want = drafter.draft_contexts(contexts, tails, anchors, params, gens(2))
        assert torch.equal(got.tokens, want.tokens) and torch.equal(got.probs, want.probs)
        many, many_tails, many_anchors = requests(drafter, 5, seed=9, longest=40)
        drafter.draft_contexts(many, many_tails, many_anchors, [params[0]] * 5, gens(5), rounds=graphs)
    assert graphs.eager_drafts == 2 and graphs.replays == 0


def test_a_missing_tail_is_refused_before_the_graphs(drafter):
    from specd.drafter import DrafterError

    graphs = Eagle3Graphs(drafter, 4, 256, CPU, replay_eagerly=True)
    contexts, tails, anchors = requests(drafter, 2, seed=10, longest=40)
    tails[1] = tails[1][:0]
    with pytest.raises(DrafterError, match="kept-back feature"):
        drafter.draft_contexts(contexts, tails, anchors, [SamplingParams(temperature=0.0)] * 2, gens(2), rounds=graphs)
    assert graphs.replays == 0


def test_the_engine_serves_eagle3_through_its_graphs_exactly(drafter):
    """A random EAGLE-3 drafter in the engine at fixed γ, its drafts from the static function (as on
    CUDA) and eagerly: the same greedy output as plain decoding (lossless), drafted tokens proposed by
    both paths alike, the graphs used at every draft."""
    from specd.engine.config import EngineConfig
    from specd.engine.engine import SpecEngine
    from specd.engine.proposers import FeatureProposer
    from tests.greedy_runs import greedy_outputs

    engine = SpecEngine.from_config(EngineConfig(max_num_seqs=8, num_local_blocks=512, spec_schedule="fixed",
                                                 device="cpu"))
    plain = greedy_outputs(engine, "plain-")
    rounds = Eagle3Graphs(drafter, 8, engine.max_model_len, CPU, replay_eagerly=True)
    outputs, drafted = [], []
    for r in (None, rounds):
        engine._proposers["eagle3"] = FeatureProposer(drafter, "eagle3", rounds=r)
        before = engine.stats().get("spec_drafted_tokens_total", 0)
        outputs.append(greedy_outputs(engine, f"{r is None}-", speculation="eagle3"))
        drafted.append(engine.stats().get("spec_drafted_tokens_total", 0) - before)
    assert outputs[0] == outputs[1] == plain
    assert drafted[0] == drafted[1] > 0
    assert rounds.replays > 0 and rounds.eager_drafts == 0


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU")
def test_cuda_graph_replay_equals_the_static_draft_and_eager():
    """On the GPU: a replay equals the same static function run eagerly on the same buffers bit for bit,
    and the eager reference's tokens (probabilities to rounding)."""
    d, dev = make_drafter("cuda", "eagle3"), torch.device("cuda")
    graphs = Eagle3Graphs(d, 16, 1024, dev)
    static = Eagle3Graphs(d, 16, 1024, dev, replay_eagerly=True)
    with torch.no_grad():
        for n, seed in ((3, 0), (16, 1), (1, 2)):
            params = [PARAMS[i % len(PARAMS)] for i in range(n)]
            contexts, tails, anchors = requests(d, n, seed, longest=600, device="cuda")
            g = lambda: [torch.Generator().manual_seed(i) for i in range(n)]     # noqa: E731
            first = graphs.run(d, contexts, tails, anchors, params, g())
            first = (first.tokens.clone(), first.probs.clone())             # captured
            again = graphs.run(d, contexts, tails, anchors, params, g())     # replayed
            ref = static.run(d, contexts, tails, anchors, params, g())
            want = d.draft_contexts(contexts, tails, anchors, params, g())
            assert torch.equal(first[0], again.tokens) and torch.equal(again.tokens, ref.tokens)
            assert torch.equal(again.probs, ref.probs)
            assert torch.equal(again.tokens, want.tokens)
            assert (again.probs - want.probs).abs().max() <= 1e-4
    assert all(g is not None for g in graphs.graphs.values()) and graphs.replays == 6


def test_warm_up_captures_the_common_keys_largest_first(drafter):
    """The proposer's warm-up captures every batch bucket x contexts up to 1K x the greedy, top-p and mixed
    paths (81 keys at 256 sequences, within the limit), largest first; a key it left out (top-k) is
    captured at first use."""
    from specd.engine.eagle3_graphs import MAX_EAGLE3_GRAPHS, WARM_PATHS
    from specd.engine.proposers import FeatureProposer

    wide = Eagle3Graphs(drafter, 256, 32768, CPU, replay_eagerly=True)
    assert len(wide.warm_keys()) == 9 * 3 * 3 <= MAX_EAGLE3_GRAPHS
    graphs = Eagle3Graphs(drafter, 8, 2048, CPU, replay_eagerly=True)
    keys = graphs.warm_keys()
    assert {(k.batch, k.context) for k in keys} == {(b, c) for b in (1, 2, 4, 8) for c in (256, 512, 1024)}
    assert {k.path for k in keys} == set(WARM_PATHS) and len(keys) == 4 * 3 * 3
    sizes = [k.batch * k.context for k in keys]
    assert sizes == sorted(sizes, reverse=True)
    proposer = FeatureProposer(drafter, "eagle3", rounds=graphs)
    assert proposer.warm_rounds() == len(keys) == proposer.round_captures
    contexts, tails, anchors = requests(drafter, 2, seed=11, longest=40)
    with torch.no_grad():
        drafter.draft_contexts(contexts, tails, anchors, [SamplingParams(temperature=1.0, top_k=20)] * 2, gens(2),
                               rounds=graphs)
    assert graphs.captures == len(keys) + 1 and graphs.eager_drafts == 0
