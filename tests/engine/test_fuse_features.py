"""The captured features fused in the forward's shadow (``SpecEngine._fuse_features`` + ``_keep_features``)
against the reference that fuses each sequence's accepted rows after the step's sync
(``_keep_features_late``), on the real stories260K target and its committed DSpark drafter.

Both paths must hand every sequence the same pending features at every step (up to the projection's
rounding by row count), so its drafts, and its outputs, are the same. Mixed batches: greedy and sampled
requests, prompts in chunks beside decoders, and a `none` request whose rows sit between the drafters'.
"""
from __future__ import annotations

import collections
from pathlib import Path

import pytest
import torch

from specd.engine.config import EngineConfig
from specd.engine.engine import SpecEngine
from specd.engine.request import Request
from specd.engine.spec_scheduler import SpsProfile
from specd.sampling_params import SamplingParams

DRAFTER = Path(__file__).resolve().parents[2] / "models" / "drafters" / "stories260K-dspark"
PROMPTS = ["Once upon a time, there was a", "Tom had a big dog. The dog", "One day, Lily went to the",
           "The sun was hot and the birds sang in the tall green trees near the old house by the sea. " * 2]


def fresh_engine() -> SpecEngine:
    """A new engine each run, with a flat SPS profile injected: the gate and the scheduler then decide from
    nothing timed (a measured profile and the gate's step times differ run to run, and so would the drafts
    and the sampled outputs). A 16-token step budget: the long prompt is prefilled in chunks beside the
    others' decode steps."""
    engine = SpecEngine.from_config(EngineConfig(max_num_seqs=8, num_local_blocks=1024, drafter=DRAFTER,
                                                 speculation="dspark", max_num_batched_tokens=16))
    engine.sps = SpsProfile.from_table({1: 100.0, 4096: 100.0})
    return engine


def run(early: bool, engine: SpecEngine | None = None):
    """Serve the mixed batch; returns (outputs by request, every pending-features snapshot in order)."""
    engine = engine or fresh_engine()
    engine.fuse_early = early
    kept: list[tuple[str, int, torch.Tensor]] = []
    keep = engine._keep_features if early else engine._keep_features_late

    def recording(batch, *args):
        keep(batch, *args)
        for sched in batch:
            feats = sched.seq.draft_feats
            if feats is not None:
                kept.append((sched.seq.request.id, engine._counters["steps_total"], feats.clone()))

    name = "_keep_features" if early else "_keep_features_late"
    setattr(engine, name, recording)
    try:
        for i, prompt in enumerate(PROMPTS):
            params = (SamplingParams(temperature=0.0, max_tokens=24) if i % 2 == 0
                      else SamplingParams(temperature=0.8, top_p=0.9, max_tokens=24, seed=11 + i))
            engine.add_request(Request(f"r{i}", engine.tokenizer.encode(prompt), params))
        engine.add_request(Request("plain", engine.tokenizer.encode(PROMPTS[1]),
                                   SamplingParams(temperature=0.0, max_tokens=24), speculation="none"))
        got = collections.defaultdict(list)
        while engine.has_work():
            for out in engine.step():
                got[out.id] += out.token_ids
    finally:
        delattr(engine, name)
    return dict(got), kept


def test_features_fused_early_equal_the_reference_at_every_step():
    late_out, late = run(early=False)
    early_out, early = run(early=True)
    assert early_out == late_out
    assert len(late) > 30                          # drafting steps and chunked prompts captured
    assert [(rid, len(f)) for rid, _, f in early] == [(rid, len(f)) for rid, _, f in late]
    assert any(len(f) > 1 for _, _, f in late)      # accepted drafts and prompt chunks: several rows at once
    for (rid, _, a), (_, _, b) in zip(early, late):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5, msg=f"request {rid}")


def test_the_comparison_catches_rows_taken_one_off(monkeypatch):
    """A planted bug: each sequence's rows read one row late. The features differ."""
    engine = fresh_engine()
    real = engine._fuse_features

    def shifted(batch, capture, captured):
        return {m: (rows, first - 1) for m, (rows, first) in real(batch, capture, captured).items()}

    _, late = run(early=False)
    monkeypatch.setattr(engine, "_fuse_features", shifted)
    try:
        _, early = run(early=True, engine=engine)
    except (IndexError, RuntimeError):
        return                                       # a shifted slice may run off the rows: caught as well
    pairs = [(a, b) for (_, _, a), (_, _, b) in zip(early, late) if a.shape == b.shape]
    assert len(pairs) < len(late) or any(not torch.allclose(a, b, atol=1e-4) for a, b in pairs)
