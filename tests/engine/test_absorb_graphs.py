"""The captured context projection (specd/engine/absorb_graphs.py) against the eager reference
(``BlockDrafter.absorb_many`` without graphs, i.e. ``context_kv`` at the exact row count).

On the CPU ``AbsorbGraphs(replay_eagerly=True)`` runs the captured function itself on the same static
buffers, padded to the token bucket. The projection is row-wise, so the contexts it fills must hold what
the reference writes: checked here up to float rounding of a matmul over a different row count (the CPU
kernels may block the rows differently), across calls whose padding rows hold an earlier call's features."""
from __future__ import annotations

import pytest
import torch

from specd.engine.absorb_graphs import ABSORB_BUCKETS, AbsorbGraphs, absorb_bucket
from tests.engine.test_block_graphs import CPU, make_drafter


@pytest.fixture(scope="module")
def drafter():
    torch.set_num_threads(1)
    return make_drafter("cpu")


def contexts_and_feats(drafter, sizes, seed):
    """Contexts already holding some positions, and new features of ``sizes`` rows for each."""
    g = torch.Generator().manual_seed(seed)
    d = drafter.config.hidden_size
    held = drafter.contexts_of([torch.randn(5 + 3 * i, d, generator=g) for i in range(len(sizes))])
    return held, [torch.randn(m, d, generator=g) for m in sizes]


def held_kv(contexts):
    return [[t.clone() for layer in range(c.num_layers) for t in c.layer(layer)] for c in contexts]


def test_buckets():
    assert absorb_bucket(1, ABSORB_BUCKETS) == 8 and absorb_bucket(8, ABSORB_BUCKETS) == 8
    assert absorb_bucket(9, ABSORB_BUCKETS) == 16 and absorb_bucket(2049, ABSORB_BUCKETS) is None
    assert AbsorbGraphs(make_drafter("cpu"), 100, CPU, replay_eagerly=True).buckets == (8, 16, 32, 64, 128)


def test_the_static_projection_fills_the_contexts_as_the_reference_does(drafter):
    graphs = AbsorbGraphs(drafter, 64, CPU, replay_eagerly=True)
    # largest first, then smaller: later calls' padding rows hold earlier calls' features
    for step, sizes in enumerate(([9, 30, 20], [1], [3, 4], [8], [2, 0, 5])):
        ref, feats = contexts_and_feats(drafter, sizes, seed=step)
        got, _ = contexts_and_feats(drafter, sizes, seed=step)
        with torch.no_grad():
            left_ref = drafter.absorb_many(ref, feats)
            left_got = drafter.absorb_many(got, feats, graphs=graphs)
        assert [f.shape for f in left_got] == [f.shape for f in left_ref]
        assert [c.n for c in got] == [c.n for c in ref]
        for a, b in zip(held_kv(got), held_kv(ref)):
            for x, y in zip(a, b):
                assert x.shape == y.shape and torch.allclose(x, y, atol=1e-6, rtol=1e-5)
    assert graphs.replays == 5 and graphs.eager_calls == 0 and graphs.captures == 2   # keys 64, 8, 8, 8, 8: 2 new


def test_more_new_tokens_than_the_largest_bucket_run_the_reference(drafter):
    graphs = AbsorbGraphs(drafter, 8, CPU, replay_eagerly=True)
    ref, feats = contexts_and_feats(drafter, [6, 5], seed=7)
    got, _ = contexts_and_feats(drafter, [6, 5], seed=7)
    with torch.no_grad():
        drafter.absorb_many(ref, feats)
        drafter.absorb_many(got, feats, graphs=graphs)
    assert graphs.eager_calls == 1 and graphs.replays == 0
    for a, b in zip(held_kv(got), held_kv(ref)):
        assert all(torch.equal(x, y) for x, y in zip(a, b))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU")
def test_cuda_graph_replay_fills_the_contexts_as_the_reference_does():
    d = make_drafter("cuda")
    graphs = AbsorbGraphs(d, 256, torch.device("cuda"))
    assert graphs.warm(d, graphs.warm_keys()) == len(graphs.buckets)
    g = torch.Generator().manual_seed(1)
    for sizes in ([100, 50], [3], [8, 8, 8]):
        held = [torch.randn(7, d.config.hidden_size, generator=g).cuda() for _ in sizes]
        feats = [torch.randn(m, d.config.hidden_size, generator=g).cuda() for m in sizes]
        ref, got = d.contexts_of(held), d.contexts_of(held)
        with torch.no_grad():
            d.absorb_many(ref, feats)
            d.absorb_many(got, feats, graphs=graphs)
        for a, b in zip(held_kv(got), held_kv(ref)):
            assert all(torch.allclose(x, y, atol=1e-5, rtol=1e-4) for x, y in zip(a, b))
    assert graphs.capture_failures == 0 and graphs.replays == 3


def test_the_engine_serves_through_the_absorb_graphs():
    """The committed stories260K DSpark drafter in the engine, its rounds through the block, round and
    context-projection graphs (their static functions, as on CUDA) and with the projection eager: the same
    greedy output, and the projection replayed at every drafting step, warmed with the others."""
    from specd.engine.block_graphs import BlockGraphs
    from specd.engine.config import EngineConfig
    from specd.engine.draft_graphs import DraftGraphs
    from specd.engine.engine import SpecEngine
    from tests.engine.test_block_graphs import STORIES
    from tests.greedy_runs import greedy_outputs

    engine = SpecEngine.from_config(EngineConfig(max_num_seqs=8, num_local_blocks=512, spec_schedule="fixed",
                                                 drafter=STORIES.parent / "drafters" / "stories260K-dspark",
                                                 speculation="dspark",
                                                 device="cpu"))  # the static functions on CPU buffers
    proposer = engine._proposer("dspark")
    outputs, used = [], None
    for with_absorbs in (False, True):
        rounds = DraftGraphs(proposer.drafter, 8, CPU, replay_eagerly=True)
        rounds.blocks = BlockGraphs(proposer.drafter, 8, engine.max_model_len, CPU, replay_eagerly=True,
                                    out=rounds.hidden)
        if with_absorbs:
            rounds.absorbs = used = AbsorbGraphs(proposer.drafter, 2048, CPU, replay_eagerly=True)
        proposer.rounds = rounds
        fresh = proposer.warm_rounds()
        outputs.append(greedy_outputs(engine, f"{with_absorbs}-"))
    assert outputs[0] == outputs[1]
    assert fresh == len(rounds.blocks.graphs) + len(rounds.graphs) + len(used.buckets)
    assert used.replays > 0 and used.eager_calls == 0 and used.replays >= rounds.blocks.replays
