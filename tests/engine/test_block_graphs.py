"""The captured block forward (specd/engine/block_graphs.py) against the eager reference
(BlockDrafter.draft_hidden).

CUDA graphs cannot be captured on the CPU, so ``BlockGraphs(replay_eagerly=True)`` runs the captured
function itself (``padded_block_hidden``) on the same static buffers. Against the same function at the
exact batch with zero padding to the same context bucket it is bit-identical: padding rows, stale keys
left in the buffers by earlier batches and the foreach fill change nothing. Against ``draft_hidden``
(padded only to the batch's longest context) it differs in rounding: SDPA's CPU kernel sums a longer
key axis in a different order (measured max |Δ| 4.8e-7 on fp32 hidden states of magnitude ~1), hence
the 1e-5 tolerance; the round then samples from exactly the probabilities it returns."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from specd.drafter import DrafterConfig, build_drafter
from specd.drafter.context_cache import padded_layer
from specd.engine.block_graphs import (BlockGraphKey, BlockGraphs, block_graph_key, block_warm_keys,
                                       context_buckets)
from specd.engine.draft_graphs import DraftGraphs, bucket
from tests.engine.test_draft_graphs import row_linears
from specd.loader import load_model
from specd.sampling_params import SamplingParams
from tests.greedy_runs import greedy_outputs

STORIES = Path(__file__).resolve().parents[2] / "models" / "stories260K.gguf"
CPU = torch.device("cpu")


def make_drafter(device: str, method: str = "dspark"):
    """A seeded random drafter on stories260K (dspark: one layer, Markov rank 16; eagle3: its one layer)."""
    model, _ = load_model(STORIES, dtype="float32", device=device)
    torch.manual_seed(0)
    extra = {"num_layers": 1, "markov_rank": 16} if method == "dspark" else {}
    d = build_drafter(DrafterConfig.for_target(model.config, method, **extra), model)
    return d.to(device).eval()


@pytest.fixture(scope="module")
def drafter():
    torch.set_num_threads(1)
    return make_drafter("cpu")


def requests(drafter, n: int, seed: int, longest: int = 300, device: str = "cpu"):
    """n contexts of mixed lengths in [1, longest] and their anchors."""
    g = torch.Generator().manual_seed(seed)
    lens = torch.randint(1, longest + 1, (n,), generator=g).tolist()
    feats = [torch.randn(m, drafter.config.hidden_size, generator=g).to(device) for m in lens]
    anchors = torch.randint(0, drafter.config.vocab_size, (n,), generator=g).tolist()
    return drafter.contexts_of(feats), anchors


def at_bucket(drafter, contexts, anchors, s: int):
    """The static function at the exact batch, contexts zero-padded to s positions."""
    kv = []
    for layer in range(len(drafter.layers)):
        k, v = padded_layer(contexts, layer)
        pad = (0, 0, 0, 0, 0, s - k.shape[1])
        kv.append((F.pad(k, pad), F.pad(v, pad)))
    lens = torch.tensor([c.n for c in contexts])
    return drafter.padded_block_hidden(torch.tensor(anchors), lens, kv)


@pytest.fixture
def row_invariant(drafter):
    """The draft layer's linears one row at a time (BLAS may round a row differently at another row
    count: tests/engine/test_draft_graphs.py), so padding rows cannot change a real row's bits."""
    places = [(mod, name) for layer in drafter.layers for mod in (layer.self_attn, layer.mlp)
              for name, child in mod.named_children() if isinstance(child, torch.nn.Linear)]
    with row_linears(places):
        yield drafter


def test_static_block_forward_on_padded_buffers_matches_the_exact_batch(row_invariant):
    """One BlockGraphs through batches of 16, 1 and 3 (stale keys of the longer batches stay in the
    buffers): each equals the same function at the exact batch, zero-padded to its bucket, to within
    rounding. Bit-identical on session 6's CPU; on session 7's (another Xeon, other BLAS kernels) the
    batch of 3 padded to 4 differed by one float32 ULP (1.2e-7 at values up to ~3). A stale key or a
    wrong bucket shows up as an error of order 1e-1, and a draft never changes an output anyway."""
    drafter = row_invariant
    graphs = BlockGraphs(drafter, 16, 512, CPU, replay_eagerly=True)
    with torch.no_grad():
        for n, seed in ((16, 0), (1, 1), (3, 2), (16, 3)):
            contexts, anchors = requests(drafter, n, seed, longest=300 if seed < 3 else 40)
            got = graphs.run(drafter, contexts, anchors).clone()
            key = graphs.key(contexts)
            assert key.batch == bucket(n, 16) and key.context == (256 if max(c.n for c in contexts) <= 256 else 512)
            torch.testing.assert_close(got, at_bucket(drafter, contexts, anchors, key.context), rtol=0, atol=1e-6)
    assert graphs.replays == 4 and graphs.eager_forwards == 0


@pytest.mark.parametrize("n", [1, 3, 16])
def test_static_block_forward_matches_draft_hidden_up_to_rounding(drafter, n):
    graphs = BlockGraphs(drafter, 16, 512, CPU, replay_eagerly=True)
    contexts, anchors = requests(drafter, n, seed=10 + n)
    with torch.no_grad():
        want = drafter.draft_hidden(contexts, anchors)
        got = graphs.run(drafter, contexts, anchors)
    assert got.shape == want.shape
    assert (got - want).abs().max() <= 1e-5


def test_buckets_and_keys():
    assert context_buckets(32768) == [256, 512, 1024, 2048, 4096, 8192, 16384, 32768]
    assert context_buckets(2000) == [256, 512, 1024, 2000] and context_buckets(100) == [100]
    buckets = context_buckets(2048)
    assert block_graph_key([5, 300], 32, buckets, 1 << 18) == BlockGraphKey(2, 512)
    assert block_graph_key([2049], 32, buckets, 1 << 18) is None                     # past the context limit
    assert block_graph_key([1] * 33, 32, buckets, 1 << 18) is None                   # past the batch
    assert block_graph_key([1500] * 32, 32, buckets, 32 * 1024) is None              # past the capacity


def test_warm_keys_cover_every_key_a_batch_can_get():
    """The warm-up enumeration equals a brute force over batch sizes and longest contexts; 45 keys at
    32 sequences and a 32K context."""
    for max_batch, max_len, cap in ((32, 32768, 1 << 18), (8, 2048, 1 << 18), (20, 3000, 1 << 14)):
        buckets = context_buckets(max_len)
        warm = block_warm_keys(max_batch, buckets, cap)
        seen = {block_graph_key([longest] * b, max_batch, buckets, cap)
                for b in range(1, max_batch + 1) for longest in range(1, max_len + 1, 7)} - {None}
        assert seen == set(warm) and len(warm) == len(set(warm))
    assert len(block_warm_keys(32, context_buckets(32768), 1 << 18)) == 45


def test_a_context_past_the_buckets_runs_the_eager_reference(drafter):
    graphs = BlockGraphs(drafter, 4, 256, CPU, replay_eagerly=True)
    contexts, anchors = requests(drafter, 2, seed=3, longest=300)
    contexts[0] = drafter.contexts_of([torch.randn(280, drafter.config.hidden_size)])[0]
    with torch.no_grad():
        got = graphs.run(drafter, contexts, anchors)
        want = drafter.draft_hidden(contexts, anchors)
    assert graphs.eager_forwards == 1 and graphs.replays == 0 and torch.equal(got, want)


def test_the_round_samples_from_the_probabilities_it_returns(drafter):
    """draft_contexts through the block graphs and the round graphs: the round's output equals the
    round run on the block graphs' hidden states, and greedy drafts are the argmax of the returned rows."""
    contexts, anchors = requests(drafter, 3, seed=4)
    params = [SamplingParams(temperature=0.0), SamplingParams(temperature=0.8, top_p=0.9),
              SamplingParams(temperature=0.0)]
    gens = lambda: [torch.Generator().manual_seed(i) for i in range(3)]      # noqa: E731
    rounds = DraftGraphs(drafter, 4, CPU, replay_eagerly=True)
    rounds.blocks = BlockGraphs(drafter, 4, 512, CPU, replay_eagerly=True, out=rounds.hidden)
    with torch.no_grad():
        got = drafter.draft_contexts(contexts, [], anchors, params, gens(), rounds=rounds)
        got = (got.tokens.clone(), got.probs.clone(), got.confidence.clone())
        hidden = rounds.blocks.run(drafter, contexts, anchors).clone()
        ref = DraftGraphs(drafter, 4, CPU, replay_eagerly=True).run(drafter, hidden, anchors, params, gens())
    assert rounds.blocks.replays == 2 and rounds.replays == 1
    assert torch.equal(got[0], ref.tokens) and torch.equal(got[1], ref.probs) and torch.equal(got[2], ref.confidence)
    for row in (0, 2):
        assert torch.equal(got[0][row], got[1][row].argmax(-1))


def test_warm_up_counts_block_and_round_graphs(drafter):
    from specd.engine.proposers import FeatureProposer

    rounds = DraftGraphs(drafter, 8, CPU, replay_eagerly=True)
    rounds.blocks = BlockGraphs(drafter, 8, 1024, CPU, replay_eagerly=True, out=rounds.hidden)
    proposer = FeatureProposer(drafter, "dspark", rounds=rounds)
    fresh = proposer.warm_rounds()
    blocks = len(block_warm_keys(8, context_buckets(1024), rounds.blocks.capacity))
    assert blocks == 4 * 3 and fresh == blocks + rounds.captures
    assert proposer.round_captures == fresh and set(rounds.blocks.graphs) == set(rounds.blocks.warm_keys())


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU")
def test_cuda_graph_replay_equals_the_static_forward_and_eager():
    """On the GPU: a replay equals the same static function run eagerly on the same buffers bit for bit,
    and draft_hidden up to the padded shapes' rounding."""
    d, dev = make_drafter("cuda"), torch.device("cuda")
    graphs = BlockGraphs(d, 16, 1024, dev)
    static = BlockGraphs(d, 16, 1024, dev, replay_eagerly=True)
    with torch.no_grad():
        for n, seed in ((3, 0), (16, 1), (1, 2)):
            contexts, anchors = requests(d, n, seed, longest=600, device="cuda")
            first = graphs.run(d, contexts, anchors).clone()          # captured
            again = graphs.run(d, contexts, anchors).clone()          # replayed
            ref = static.run(d, contexts, anchors)
            want = d.draft_hidden(contexts, anchors)
            assert torch.equal(first, again) and torch.equal(again, ref)
            assert (again - want).abs().max() <= 1e-4
    assert all(g is not None for g in graphs.graphs.values()) and graphs.replays == 6


def test_the_engine_serves_through_the_block_graphs():
    """The committed stories260K DSpark drafter in the engine, its rounds through block graphs and round
    graphs (the static functions, as on CUDA) and eagerly: the same greedy output, the graphs used."""
    from specd.engine.config import EngineConfig
    from specd.engine.engine import SpecEngine

    drafter_dir = STORIES.parent / "drafters" / "stories260K-dspark"
    engine = SpecEngine.from_config(EngineConfig(max_num_seqs=8, num_local_blocks=512, spec_schedule="fixed",
                                                 drafter=drafter_dir, speculation="dspark",
                                                 device="cpu"))  # the static functions on CPU buffers
    proposer = engine._proposer("dspark")
    rounds = DraftGraphs(proposer.drafter, 8, CPU, replay_eagerly=True)
    rounds.blocks = BlockGraphs(proposer.drafter, 8, engine.max_model_len, CPU, replay_eagerly=True, out=rounds.hidden)
    outputs = []
    for r in (None, rounds):
        proposer.rounds = r
        outputs.append(greedy_outputs(engine, f"{r is None}-"))
    assert outputs[0] == outputs[1]
    assert rounds.blocks.replays > 0 and rounds.blocks.eager_forwards == 0 and rounds.replays == rounds.blocks.replays


def test_the_draft_round_profile_times_the_block_graph(tmp_path):
    """python -m bench.gpu_profile --draft-round --tiny: the graph block forward beside the eager one."""
    from bench.gpu_profile import profile_draft_round

    profile_draft_round("tiny", [1, 3], tmp_path)
    res = json.loads((tmp_path / "draft_round-tiny.json").read_text())
    for name in ("b1_greedy", "b3_T0.7-k20-p0.9"):
        row = res[name]
        assert row["block_forward_graph"]["total_ms_p50"] > 0 and row["block_forward"]["total_ms_p50"] > 0
        assert row["block_graph_max_abs_hidden_diff"] <= 1e-5
        assert row["block_graph_tokens_equal_fraction"] >= 0.9
        assert row["absorb_graph"]["total_ms_p50"] > 0 and row["absorb_eager"]["total_ms_p50"] > 0
        assert row["absorb_graph_max_abs_kv_diff"] <= 1e-5
