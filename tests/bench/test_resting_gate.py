"""bench/resting_gate.py: the `dspark-resting` row's gate, which never drafts, runs the engine's side of a resting
cell, rest spans through admissions included."""
from __future__ import annotations

import collections
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
BASE = ["Once upon a time, there was a", "Tom had a big dog. The dog", "One day, Lily went to the",
        "The sun was hot and", "A little bird sat on", "Max liked to play with"]


@pytest.fixture(scope="module")
def engine():
    from specd.engine.config import EngineConfig
    from specd.engine.engine import SpecEngine

    return SpecEngine.from_config(EngineConfig(max_num_seqs=4, num_local_blocks=1024, speculation="none",
                                               drafters=f"dspark={ROOT / 'models' / 'drafters' / 'stories260K-dspark'}"))


def _serve(engine, spec: str, tag: str) -> tuple[dict, dict]:
    """A closed loop at c = 4 with answers of 10-39 tokens, so requests are admitted while others decode."""
    from specd.engine.request import Request
    from specd.sampling_params import SamplingParams

    got, before = collections.defaultdict(list), engine.stats()
    queue, inflight = collections.deque(range(16)), 0
    while queue or engine.has_work():
        while queue and inflight < 4:
            i = queue.popleft()
            params = SamplingParams(temperature=0.0, max_tokens=10 + (i * 7) % 30, ignore_eos=True)
            engine.add_request(Request(f"{tag}{i}", engine.tokenizer.encode(BASE[i % len(BASE)]), params,
                                       speculation=spec))
            inflight += 1
        for out in engine.step():
            got[out.id[len(tag):]] += out.token_ids
            inflight -= out.finished
    after = engine.stats()
    return dict(got), {k: after[k] - before.get(k, 0) for k in after if k.startswith("spec_") and isinstance(after[k], int)}


def test_the_resting_gate_lets_requests_join_its_rest_so_spans_go_on_through_admissions(engine):
    """``RestingGate.join_rest``: a request admitted into a resting batch joins its rest, so the rest span goes
    on (the real gate's does in a resting cell, ``SpecGate.join_rest``); with the real gate's refusal (this
    gate keeps no rest bound) every admission ended the span. Nothing drafts either way, and greedy outputs
    are plain decoding's."""
    from bench.resting_gate import RestingGate
    from specd.engine.spec_gate import SpecGate

    gate = engine.spec_gate
    want, _ = _serve(engine, "none", "n")
    try:
        engine.spec_gate = RestingGate()
        got, joined = _serve(engine, "dspark", "j")
        refusing = RestingGate()
        refusing.join_rest = lambda method, sequences, requests: SpecGate.join_rest(refusing, method, sequences, requests)
        refusing.rejoin_rest = lambda method, sequences: SpecGate.rejoin_rest(refusing, method, sequences)
        engine.spec_gate = refusing
        old, refused = _serve(engine, "dspark", "r")
    finally:
        engine.spec_gate = gate
    assert got == old == want
    assert joined["spec_verifications_total"] == refused["spec_verifications_total"] == 0
    assert joined["spec_paused_steps_total"] == refused["spec_paused_steps_total"] > 50
    assert joined["spec_rest_span_steps_total"] > refused["spec_rest_span_steps_total"] + 10
    assert joined["spec_rest_span_steps_total"] > 0.8 * joined["spec_paused_steps_total"]
