"""The captured sampling round (specd/engine/draft_graphs.py) against the eager reference
(BlockDrafter.sample_drafts): same tokens, probabilities and confidences, with padding rows inert.

CUDA graphs cannot be captured on the CPU, so ``DraftGraphs(replay_eagerly=True)`` runs the captured
function itself (``markov_round``) on the same padded static buffers. The drafter's small matmuls (the
Markov head's W2, the confidence head) round differently at a padded row count (BLAS picks kernels
by M: on this CPU rows of an M=3 and an M=4 F.linear differ in their last bits), so the bit-identity
test gives both paths row-by-row linears; a second test keeps the real ones and checks closeness."""
from __future__ import annotations

import contextlib

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from specd.drafter import DrafterConfig, build_drafter
from specd.drafter.base import BlockOut
from specd.engine.draft_graphs import DraftGraphs, bucket
from specd.engine.sampler import SamplingPath
from specd.loader import load_model
from specd.sampling_params import SamplingParams
from tests.greedy_runs import greedy_outputs

STORIES = Path(__file__).resolve().parents[2] / "models" / "stories260K.gguf"
GREEDY = SamplingParams(temperature=0.0)
SETTINGS = {
    "greedy": [GREEDY],
    "plain": [SamplingParams(temperature=0.8)],
    "top_k": [SamplingParams(temperature=0.7, top_k=20, top_p=0.9), SamplingParams(temperature=1.1, top_k=5)],
    "top_p": [SamplingParams(temperature=1.2, top_p=0.8)],
    "mixed": [GREEDY, SamplingParams(temperature=0.7, top_k=20, top_p=0.9), SamplingParams(temperature=1.0),
              SamplingParams(temperature=1.2, top_p=0.8), SamplingParams(temperature=0.5, top_k=3)],
}


class RowLinear(torch.nn.Module):
    """A linear applied one row at a time, so a row's result never depends on the row count."""

    def __init__(self, linear: torch.nn.Linear):
        super().__init__()
        self.weight, self.bias = linear.weight, linear.bias

    def forward(self, x):
        rows = x.reshape(-1, x.shape[-1])
        out = torch.cat([F.linear(r[None], self.weight, self.bias) for r in rows])
        return out.view(*x.shape[:-1], -1)


def make_drafter(device: str):
    model, _ = load_model(STORIES, dtype="float32", device=device)
    torch.manual_seed(0)
    d = build_drafter(DrafterConfig.for_target(model.config, "dspark", num_layers=1, markov_rank=16), model)
    torch.nn.init.normal_(d.markov_head.markov_w2.weight, std=1.0)      # make the Markov bias matter
    torch.nn.init.normal_(d.confidence_head.proj.weight, std=0.5)
    return d.to(device).eval()


@pytest.fixture(scope="module")
def drafter():
    torch.set_num_threads(1)
    return make_drafter("cpu")


@contextlib.contextmanager
def row_linears(places):
    """Each (module, child name) of ``places`` replaced by ``RowLinear`` of that child, and put back after.

    Not ``monkeypatch.setattr``: from pytest 9.2 its undo deletes an attribute it did not find in the
    object's ``__dict__``, and a torch module keeps its children in ``_modules``, so the undo removed the
    module-scoped drafter's linears and every later test that used it failed."""
    places = [(module, name, getattr(module, name)) for module, name in places]
    for module, name, child in places:
        setattr(module, name, RowLinear(child))
    try:
        yield
    finally:
        for module, name, child in places:
            setattr(module, name, child)


@pytest.fixture
def row_invariant(drafter):
    with row_linears([(drafter.markov_head, "markov_w2"), (drafter.confidence_head, "proj")]):
        yield drafter


def batch(drafter, n: int, kind: str, seed: int = 0):
    """hidden [n, γ, d] with a spread of logits, anchors, per-row settings and fresh seeded generators."""
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(n, drafter.config.gamma, drafter.config.hidden_size, generator=g) * 3
    anchors = torch.randint(0, drafter.config.vocab_size, (n,), generator=g).tolist()
    params = [SETTINGS[kind][i % len(SETTINGS[kind])] for i in range(n)]
    return hidden, anchors, params


def gens(n: int, seed: int = 0):
    return [torch.Generator().manual_seed(1000 * seed + i) for i in range(n)]


def both(drafter, n, kind, seed=0, max_batch=16):
    hidden, anchors, params = batch(drafter, n, kind, seed)
    with torch.no_grad():
        want = drafter.sample_drafts(BlockOut(drafter.heads.logits(hidden), hidden), anchors, params, gens(n, seed))
        graphs = DraftGraphs(drafter, max_batch, torch.device("cpu"), replay_eagerly=True)
        got = graphs.run(drafter, hidden, anchors, params, gens(n, seed))
    return want, got, graphs


@pytest.mark.parametrize("kind", sorted(SETTINGS))
@pytest.mark.parametrize("n", [1, 3, 12, 16])
def test_static_round_on_padded_inputs_is_bit_identical_to_eager(row_invariant, kind, n):
    for seed in range(2):
        want, got, graphs = both(row_invariant, n, kind, seed)
        assert graphs.replays == 1 and graphs.eager_rounds == 0
        assert next(iter(graphs.graphs)).batch == bucket(n, 16)
        assert torch.equal(got.tokens, want.tokens)
        assert torch.equal(got.probs, want.probs)
        assert torch.equal(got.confidence, want.confidence)


def test_padding_rows_do_not_touch_real_rows(row_invariant):
    """The same 3 requests after a round of 4 other requests in the same buffers: identical output."""
    d = row_invariant
    hidden, anchors, params = batch(d, 3, "mixed")
    graphs = DraftGraphs(d, 16, torch.device("cpu"), replay_eagerly=True)
    with torch.no_grad():
        first = graphs.run(d, hidden, anchors, params, gens(3))
        first = (first.tokens.clone(), first.probs.clone())
        graphs.run(d, *batch(d, 4, "top_p", seed=5), gens(4, 5))
        again = graphs.run(d, hidden, anchors, params, gens(3))
    assert torch.equal(again.tokens, first[0]) and torch.equal(again.probs, first[1])


@pytest.mark.parametrize("kind", ["greedy", "mixed"])
def test_real_heads_match_eager_up_to_rounding(drafter, kind):
    want, got, _ = both(drafter, 3, kind)
    assert (got.probs - want.probs).abs().max() <= 1e-5
    assert (got.confidence - want.confidence).abs().max() <= 1e-5
    assert (got.tokens == want.tokens).float().mean() >= 0.9


def test_the_sampling_path_keys_the_graph():
    vocab = 512
    assert SamplingPath.of([GREEDY] * 3, vocab) == SamplingPath(greedy=True)
    assert SamplingPath.of(SETTINGS["top_k"], vocab) == SamplingPath(max_k=20)
    assert SamplingPath.of(SETTINGS["mixed"], vocab) == SamplingPath(True, True, 20, True)
    assert bucket(3, 16) == 4 and bucket(16, 16) == 16 and bucket(17, 16) is None and bucket(20, 24) == 24


def test_a_batch_past_the_largest_bucket_runs_the_eager_reference(row_invariant):
    hidden, anchors, params = batch(row_invariant, 5, "mixed")
    graphs = DraftGraphs(row_invariant, 4, torch.device("cpu"), replay_eagerly=True)
    with torch.no_grad():
        got = graphs.run(row_invariant, hidden, anchors, params, gens(5))
        want = row_invariant.sample_drafts(BlockOut(row_invariant.heads.logits(hidden), hidden), anchors, params,
                                           gens(5))
    assert graphs.eager_rounds == 1 and torch.equal(got.probs, want.probs)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU")
def test_cuda_graph_replay_equals_the_static_round_and_eager():
    """On the GPU: the replayed graph equals the same static function run eagerly on the same buffers
    (bit for bit), and the eager reference up to the padded matmuls' rounding."""
    d, dev = make_drafter("cuda"), torch.device("cuda")
    for kind in ("greedy", "mixed", "top_k"):
        hidden, anchors, params = batch(d, 3, kind)
        hidden = hidden.to(dev)
        with torch.no_grad():
            graphs = DraftGraphs(d, 16, dev)
            got = graphs.run(d, hidden, anchors, params, gens(3))
            got = (got.tokens.clone(), got.probs.clone())
            again = graphs.run(d, hidden, anchors, params, gens(3))           # a replay of the captured graph
            static = DraftGraphs(d, 16, dev, replay_eagerly=True).run(d, hidden, anchors, params, gens(3))
            want = d.sample_drafts(BlockOut(d.heads.logits(hidden), hidden), anchors, params, gens(3))
        assert graphs.replays == 2 and all(g is not None for g in graphs.graphs.values())
        assert torch.equal(again.tokens, got[0]) and torch.equal(again.probs, got[1])
        assert torch.equal(got[0], static.tokens) and torch.equal(got[1], static.probs)
        assert (got[1] - want.probs).abs().max() <= 1e-4
        assert (got[0] == want.tokens).float().mean() >= 0.9


def test_the_draft_round_profile_runs_at_tiny_sizes(tmp_path):
    """The lead's GPU entry point (python -m bench.gpu_profile --draft-round) as a CPU smoke test."""
    import json

    from bench.gpu_profile import profile_draft_round

    profile_draft_round("tiny", [1, 3], tmp_path)
    res = json.loads((tmp_path / "draft_round-tiny.json").read_text())
    for name in ("b1_greedy", "b3_T1", "b3_T0.7-k20-p0.9"):
        row = res[name]
        assert row["graph_tokens_equal_fraction"] >= 0.9 and row["graph_max_abs_probs_diff"] <= 1e-5
        assert all(row[k]["total_ms_p50"] > 0 for k in ("block_forward", "markov_eager", "markov_graph",
                                                        "verify_per_sequence", "verify_vectorized"))
    # the parts `bench sps-projection --draft-round` charges a drafting step read from these rows
    from bench.sps_projection import ROUND_PARTS, measured_rounds

    assert all(res["b3_greedy"][k]["total_ms_p50"] > 0 for k in ROUND_PARTS)
    assert set(measured_rounds(tmp_path / "draft_round-tiny.json", "greedy")) == {1, 3}


def test_the_engine_serves_through_the_draft_rounds():
    """The committed stories260K DSpark drafter in the engine, its rounds through DraftGraphs (the
    static function, as on CUDA) and eagerly: the same greedy output, the rounds replayed."""
    from specd.engine.config import EngineConfig
    from specd.engine.engine import SpecEngine

    drafter_dir = STORIES.parent / "drafters" / "stories260K-dspark"
    engine = SpecEngine.from_config(EngineConfig(max_num_seqs=8, num_local_blocks=512, spec_schedule="fixed",
                                                 drafter=drafter_dir, speculation="dspark",
                                                 device="cpu"))  # the static functions on CPU buffers
    proposer = engine._proposer("dspark")
    outputs = []
    for rounds in (None, DraftGraphs(proposer.drafter, 8, torch.device("cpu"), replay_eagerly=True)):
        proposer.rounds = rounds
        before = engine.stats()["spec_accepted_tokens_total"]
        outputs.append(greedy_outputs(engine, f"{rounds is None}-"))
        assert engine.stats()["spec_accepted_tokens_total"] > before
    assert outputs[0] == outputs[1] and rounds.replays > 0
