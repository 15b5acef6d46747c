"""The speculative CUDA-graph warm-up: which step and draft-round shapes are captured when a method loads,
and that a speculative run then meets no decode/verify shape outside them.

The enumerations are pure functions, checked against a brute force over every step ``graph_key`` can see.
On the CPU there are no graphs, so the engine tests record the key each step *would* replay
(``ModelRunner.step_key``) and the key each draft round would (``draft_graph_key``); the replay-eager
StepGraphs / DraftGraphs run the real warm-up code on inert inputs.
"""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

from specd.engine.cuda_graphs import (GraphKey, decode_keys, graph_key, plain_keys, prefill_keys, speculative_keys,
                                      verify_keys)
from specd.engine.draft_graphs import DraftGraphKey, DraftGraphs, draft_graph_key, warm_keys
from specd.engine.sampler import SamplingPath
from specd.sampling_params import SamplingParams

torch.set_num_threads(1)

ROOT = Path(__file__).resolve().parents[2]
DRAFTER = ROOT / "models" / "drafters" / "stories260K-dspark"
PROMPTS = [        # 27-34 tokens each: every prompt step is prefill-shaped (a query block above 16)
    "Once upon a time, there was a little girl named Lily who loved to play outside in the",
    "Tom had a big dog. The dog liked to run in the park and play with the ball every",
    "One day, Lily went to the store with her mom to buy some food for the",
    "The sun was hot and the children wanted to swim in the big blue lake near the",
    "Lily and Ben played in the park. They saw a big red ball under the tree and",
    "A little bird sat on a branch of the tall tree and sang a happy song to the"]
GREEDY = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)
NUCLEUS = SamplingParams(temperature=0.7, top_p=0.9, max_tokens=20, ignore_eos=True)


# ---- the enumerations (pure) -------------------------------------------------------------------------

def _brute_verify(max_seqs: int, max_tokens: int, gamma: int, capture) -> set[GraphKey]:
    """graph_key of every (sequences B, tokens n, longest query m) a verify step can have: 2 ≤ m ≤ γ+1
    (≤ 16: longer ones are prefill-shaped), the other B-1 sequences 1..m tokens each."""
    keys = set()
    for b in range(1, max_seqs + 1):
        for m in range(2, min(gamma + 1, 16) + 1):
            for n in range(m + b - 1, b * m + 1):
                key = graph_key(n, b, m, max_seqs, max_tokens, capture)
                if key is not None:
                    keys.add(key)
    return keys


@pytest.mark.parametrize("max_seqs,max_tokens,gamma", [(1, 16, 1), (3, 24, 3), (8, 120, 7), (8, 40, 7),
                                                       (12, 2272, 15), (5, 64, 4)])
def test_verify_keys_are_exactly_what_graph_key_gives_verify_steps(max_seqs, max_tokens, gamma):
    got = verify_keys(max_seqs, max_tokens, gamma, (1, 2))
    assert len(got) == len(set(got))
    assert set(got) == _brute_verify(max_seqs, max_tokens, gamma, (1, 2))


@pytest.mark.parametrize("max_seqs", [1, 5, 8, 20, 32, 256])
def test_decode_keys_are_exactly_what_graph_key_gives_decode_steps(max_seqs):
    want = {graph_key(b, b, 1, max_seqs, 4096, (3,)) for b in range(1, max_seqs + 1)}
    assert set(decode_keys(max_seqs, (3,))) == want and None not in want


def _brute_prefill(max_seqs: int, max_tokens: int, capture) -> set[GraphKey]:
    """graph_key of every (sequences B, tokens n, longest query m) a prefill-shaped step can have: m > 16
    (a prompt chunk), the other B-1 sequences 1..m tokens each, n ≤ max_tokens."""
    keys = set()
    for b in range(1, max_seqs + 1):
        for m in range(17, max_tokens + 1):
            for n in range(m + b - 1, min(b * m, max_tokens) + 1):
                key = graph_key(n, b, m, max_seqs, max_tokens, capture)
                if key is not None:
                    keys.add(key)
    return keys


@pytest.mark.parametrize("max_seqs,max_tokens", [(1, 16), (1, 40), (3, 100), (8, 200), (4, 64)])
def test_prefill_keys_are_exactly_what_graph_key_gives_prompt_chunks(max_seqs, max_tokens):
    got = prefill_keys(max_tokens, (1,))
    assert len(got) == len(set(got)) and set(got) == _brute_prefill(max_seqs, max_tokens, (1,))
    assert all(k.tokens == k.q_bound for k in got)


def test_plain_keys_are_decode_and_prompt_chunks_capturing_nothing():
    assert plain_keys(4, 64) == decode_keys(4, ()) + [GraphKey(32, 32, ()), GraphKey(48, 48, ()), GraphKey(64, 64, ())]


def test_speculative_keys_for_one_feature_method():
    got = speculative_keys(4, 64, [((1, 2), 3)])
    c = (1, 2)
    assert got == [GraphKey(64, 64, c), GraphKey(48, 48, c), GraphKey(32, 32, c),        # prompt chunks
                   GraphKey(16, 4, c), GraphKey(8, 4, c), GraphKey(8, 2, c),
                   GraphKey(4, 1, c), GraphKey(2, 1, c), GraphKey(1, 1, c)]      # largest first


def test_speculative_keys_cover_every_mix_of_methods():
    """dspark (layers (1, 2), γ 3) and ngram (no layers, γ 7): ngram verifies capture nothing; a batch with
    both verifies up to 8 tokens per sequence while capturing dspark's layers."""
    got = speculative_keys(4, 64, [((1, 2), 3), ((), 7)])
    want = (set(decode_keys(4, (1, 2))) | set(verify_keys(4, 64, 3, (1, 2))) | set(prefill_keys(64, (1, 2)))
            | set(verify_keys(4, 64, 7, ())) | set(verify_keys(4, 64, 7, (1, 2))))
    assert set(got) == want and len(got) == len(want)
    assert GraphKey(32, 8, (1, 2)) in got and GraphKey(32, 8, ()) in got
    assert not any(k.q_bound == 1 and not k.capture for k in got)     # plain decode: the runner's own


def test_default_deployment_fits_under_the_graph_cap():
    from specd.engine.cuda_graphs import MAX_GRAPHS

    keys = speculative_keys(32, 2048 + 32 * 7, [((0, 1, 2, 3), 7), ((), 7)])
    assert len(keys) + len(plain_keys(32, 2048 + 32 * 7)) == 84 <= MAX_GRAPHS
    keys = speculative_keys(256, 2048 + 256 * 7, [((0, 1, 2, 3), 7), ((), 7)])
    assert len(keys) + len(plain_keys(256, 2048 + 256 * 7)) == 134 <= MAX_GRAPHS


def test_warm_draft_keys():
    paths = [SamplingPath(greedy=True), SamplingPath(plain=True), SamplingPath(max_k=20), SamplingPath(top_p=True),
             SamplingPath(greedy=True, top_p=True)]
    assert warm_keys(3, 512) == [DraftGraphKey(b, p) for b in (3, 2, 1) for p in paths]
    assert warm_keys(3, 16) == [DraftGraphKey(b, p) for b in (3, 2, 1) for p in paths if not p.max_k]
    assert len(warm_keys(32, 512)) == 30
    # the requests the paths stand for get exactly those keys
    mixed = [GREEDY, NUCLEUS, GREEDY]
    assert draft_graph_key(mixed, 32, 512) == DraftGraphKey(4, SamplingPath(greedy=True, top_p=True))
    assert draft_graph_key([SamplingParams(temperature=0.7, top_k=20)] * 5, 32, 512) in warm_keys(32, 512)
    assert draft_graph_key([SamplingParams(temperature=0.7, top_k=40)], 32, 512) not in warm_keys(32, 512)


# ---- the engine --------------------------------------------------------------------------------------

def _engine(**kw):
    from specd.engine.config import EngineConfig
    from specd.engine.engine import SpecEngine

    return SpecEngine.from_config(EngineConfig(max_num_seqs=8, num_local_blocks=512, max_num_batched_tokens=256,
                                               drafter=DRAFTER, speculation="dspark", **kw))


def _record(engine, proposer):
    """Wrap the runner and the drafter: (the step key of every target step, draft-round keys) met."""
    from specd.engine.model_runner import host_step

    steps, rounds = [], []
    run, draft = engine.runner.run, proposer.drafter.draft_contexts

    def recording_run(batch, capture_layers=()):
        step, _ = host_step(batch, engine.layout.block_size)
        steps.append(engine.runner.step_key(step, tuple(capture_layers)))
        return run(batch, capture_layers)

    def recording_draft(ctxs, feats, last, params, gens, **kw):
        rounds.append(draft_graph_key(params, engine.config.max_num_seqs, proposer.drafter.config.vocab_size))
        return draft(ctxs, feats, last, params, gens, **kw)

    engine.runner.run = recording_run
    proposer.drafter.draft_contexts = recording_draft
    return steps, rounds


def _serve(engine, waves):
    """Each wave: (count, params, method, schedule) requests added together, run to the end."""
    from specd.engine.request import Request

    tag = 0
    for count, params, method, schedule in waves:
        for i in range(count):
            engine.add_request(Request(f"w{tag}-{i}", engine.tokenizer.encode(PROMPTS[i % len(PROMPTS)]), params,
                                       speculation=method, spec_schedule=schedule))
        tag += 1
        while engine.has_work():
            for out in engine.step():
                assert out.error is None


WAVES = [(1, GREEDY, "dspark", "fixed"), (3, GREEDY, "dspark", None), (8, GREEDY, "dspark", "fixed"),
         (5, NUCLEUS, "dspark", "fixed"), (4, GREEDY, "ngram", None), (6, NUCLEUS, "dspark", None),
         # plain decode at 8: whether the gated waves above rest at 5-8 sequences depends on CPU timing
         (8, GREEDY, "none", None)]


def test_a_speculative_run_meets_only_warmed_shapes():
    engine = _engine()
    proposer = engine._proposer("dspark")
    engine._proposer("ngram")
    steps, rounds = _record(engine, proposer)
    _serve(engine, WAVES)
    from specd.engine.request import Request

    # the waves above kept one sampling setting per batch; greedy and nucleus requests in one batch:
    for i, params in enumerate([GREEDY, NUCLEUS, GREEDY]):
        engine.add_request(Request(f"mix{i}", engine.tokenizer.encode(PROMPTS[i]), params, speculation="dspark",
                                   spec_schedule="fixed"))
    while engine.has_work():
        engine.step()

    warmed = set(engine.speculative_graph_keys()) | set(plain_keys(engine.runner.max_batch, engine.runner.max_tokens))
    assert steps and None not in steps
    assert set(steps) <= warmed, set(steps) - warmed
    assert any(k.q_bound > 16 and k.capture == () for k in steps)        # plain prompt chunks were met
    assert any(k.q_bound > 16 and k.capture for k in steps)              # and prompts capturing features
    layers = proposer.capture_layers
    assert any(k.q_bound > 1 and k.capture == layers for k in steps)      # dspark verify steps were met
    assert any(k.q_bound > 1 and k.capture == () for k in steps)          # ngram verify steps were met
    assert {k.tokens for k in steps if k.q_bound == 1} >= {1, 4, 8}
    drafted = set(warm_keys(engine.config.max_num_seqs, proposer.drafter.config.vocab_size))
    assert rounds and set(rounds) <= drafted, set(rounds) - drafted
    assert any(k.path == SamplingPath(greedy=True, top_p=True) for k in rounds)


def test_warm_up_captures_the_enumeration_and_the_run_captures_no_decode_or_verify_shape():
    """The real warm-up code on replay-eager graphs (inert inputs through the model and the Markov loop),
    counted in graph_stats; then a speculative run adds only prefill-shaped graphs."""
    from specd.engine.cuda_graphs import StepGraphs

    engine = _engine()
    runner = engine.runner
    runner.graphs = StepGraphs(engine.model, runner.backend, 8, runner.max_tokens, 64, engine.device,
                               replay_eagerly=True)
    runner.warm(plain_keys(8, runner.graphs.max_tokens))
    assert engine.sps is None
    proposer = engine._proposer("dspark")             # loads, and (graphs present, spec_warmup on) warms
    assert engine.sps is not None                     # the SPS profile's own verify shapes ran at load too
    want = set(runner.graphs.graphs)
    assert want >= set(engine.speculative_graph_keys()) | set(plain_keys(8, runner.graphs.max_tokens))
    assert engine.graph_stats()["graph_captures_total"] == len(want)
    proposer.rounds = DraftGraphs(proposer.drafter, 8, engine.device, replay_eagerly=True)
    assert proposer.warm_rounds() == len(warm_keys(8, 512)) == 20
    before = engine.graph_stats()
    assert before["draft_graph_captures_total"] == 20
    _serve(engine, WAVES[:4])
    assert set(runner.graphs.graphs) == want          # prompt chunks too since session 14: nothing new
    after = engine.graph_stats()
    assert after["draft_graph_captures_total"] == 20
    assert after["graph_captures_total"] == before["graph_captures_total"]
    assert proposer.rounds.replays > 0


def test_warm_up_off_or_without_graphs_loads_nothing_at_start():
    assert _engine()._proposers == {}                  # CPU: no graphs, nothing to warm
    engine = _engine(spec_warmup=False)
    assert engine._proposers == {} and engine.graph_stats() == {"graph_captures_total": 0,
                                                                 "draft_graph_captures_total": 0,
                                                                 "triton_compiles_total": 0,
                                                                 "eager_steps_total": 0}


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU")
def test_cuda_after_warm_up_a_speculative_run_captures_no_decode_verify_or_draft_graph():
    engine = _engine(device="cuda")
    assert "dspark" in engine._proposers               # loaded and warmed at start
    graphs = engine.runner.graphs
    warmed = set(graphs.graphs)
    assert warmed >= set(engine.speculative_graph_keys())
    rounds = engine._proposers["dspark"].rounds
    assert rounds is not None and set(rounds.graphs) >= set(warm_keys(8, rounds.vocab))
    before = engine.graph_stats()
    _serve(engine, WAVES[:4])
    assert set(graphs.graphs) == warmed               # prompt chunks too since session 14: nothing new
    after = engine.graph_stats()
    assert after["draft_graph_captures_total"] == before["draft_graph_captures_total"]
    assert after["graph_captures_total"] == before["graph_captures_total"]


def test_warm_up_stops_at_the_graph_cap(monkeypatch, caplog):
    """Past MAX_GRAPHS the warm-up captures the largest shapes, logs the rest, and they run eagerly."""
    import specd.engine.cuda_graphs as cg

    engine = _engine()
    runner = engine.runner
    runner.graphs = cg.StepGraphs(engine.model, runner.backend, 8, runner.max_tokens, 64, engine.device,
                                  replay_eagerly=True)
    monkeypatch.setattr(cg, "MAX_GRAPHS", 3)
    keys = decode_keys(8, ())
    assert runner.warm(keys) == 3 and set(runner.graphs.graphs) == set(keys[-3:])
    assert "past MAX_GRAPHS" in caplog.text
    assert not runner.graphs.can_run(keys[0])


def test_past_the_cap_the_warm_up_drops_prompt_shapes_before_decode_and_verify_ones(monkeypatch):
    """Two feature drafters and ngram at 32 sequences need 168 graphs with prompt chunks. Over the cap, a
    prompt shape (met once per prompt) goes before a decode or verify shape (met every step)."""
    import specd.engine.cuda_graphs as cg

    assert len(speculative_keys(32, 2272, [((0, 1, 2, 3), 7), ((5, 10, 20), 7), ((), 7)])) + \
        len(plain_keys(32, 2272)) == 168 <= cg.MAX_GRAPHS
    engine = _engine()
    runner = engine.runner
    runner.graphs = cg.StepGraphs(engine.model, runner.backend, 8, runner.max_tokens, 64, engine.device,
                                  replay_eagerly=True)
    monkeypatch.setattr(cg, "MAX_GRAPHS", 6)
    decode, prompt = decode_keys(4, ()), prefill_keys(64, ())     # 3 + 3 keys, the prompt ones larger
    assert runner.warm(prompt + decode) == 6
    monkeypatch.setattr(cg, "MAX_GRAPHS", 8)
    runner.graphs.graphs.clear()
    more = decode_keys(4, (1,)) + prefill_keys(64, (1,))
    assert runner.warm(decode + prompt + more) == 8
    kept = set(runner.graphs.graphs)
    assert set(decode) | set(decode_keys(4, (1,))) <= kept          # every decode shape
    assert kept - set(decode) - set(decode_keys(4, (1,))) == {GraphKey(64, 64, ()), GraphKey(64, 64, (1,))}
