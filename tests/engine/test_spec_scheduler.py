"""The causal confidence scheduler: the greedy with its early stop on hand-computed cases, its budget
under load, its causality (later confidences never change a decision), the SPS profile, and the engine
with the committed stories260K DSpark drafter (greedy outputs unchanged, shorter drafts under load)."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch
from hypothesis import given, settings, strategies as st

from specd.engine.config import EngineConfig
from specd.engine.engine import SpecEngine
from specd.engine.spec_scheduler import (SchedulerError, SpsProfile, calibrate, profile_points, schedule_verify,
                                         survivals)
from specd.sampling_params import SamplingParams
from tests.greedy_runs import batch_outputs

torch.set_num_threads(1)

# flat-ish to a knee at 16 batch tokens, then compute-bound (exactly ∝ 1/B past the last point): the shape
# of a GPU verify step
KNEE = SpsProfile.from_table({1: 100.0, 16: 95.0})


def theta(confidences, lengths, sps: SpsProfile) -> float:
    tau = sum(1 + sum(survivals(row)[:k]) for row, k in zip(confidences, lengths))
    return tau * sps.sps(sum(1 + k for k in lengths))


def test_two_requests_by_hand():
    sps = SpsProfile.from_table({2: 10.0, 3: 9.0, 4: 6.0})
    # a: A1 = .5; B1 = .8, B2 = .4. Θ0 = 2·10 = 20; +B1: 2.8·9 = 25.2; +A1: 3.3·6 = 19.8 -> stop
    assert schedule_verify([[0.5], [0.8, 0.5]], sps) == [0, 1]


def test_ties_go_to_the_earlier_request():
    sps = SpsProfile.from_table({2: 10.0, 3: 9.0, 4: 6.0})
    # +r0: 2.8·9 = 25.2 > 20; +r1: 3.6·6 = 21.6 -> stop
    assert schedule_verify([[0.8], [0.8]], sps) == [1, 0]


def test_early_stop_ignores_a_better_admission_behind_it():
    sps = SpsProfile.from_table({1: 1.0, 2: 1.0, 3: 0.5, 8: 0.5})
    conf = [[0.9] * 7]
    # Θ: ℓ=0 -> 1, ℓ=1 -> 1.9, ℓ=2 -> 2.71·0.5 = 1.355 (stop), while ℓ=7 would give (1 + Σ .9^j)·0.5 ≈ 2.76
    assert theta(conf, [7], sps) > theta(conf, [1], sps)
    assert schedule_verify(conf, sps) == [1]


def test_the_papers_appendix_a_profile_never_speculates():
    # SPS 1 / 0.5 / 0.45 for B = 1 / 2 / 3: one draft never pays, two would when a1 + a2 > 1.22; a search
    # that admits x1 only when c2 (computed from x1) is high is exactly the biased rule of Appendix A
    sps = SpsProfile.from_table({1: 1.0, 2: 0.5, 3: 0.45})
    for conf in ([1.0, 1.0], [0.99, 0.99], [0.9, 0.3], [0.5, 0.9]):
        assert schedule_verify([conf], sps) == [0]


def test_flat_profile_admits_every_draft_with_a_chance():
    sps = SpsProfile.from_table({1: 50.0, 64: 50.0})
    assert schedule_verify([[0.9, 0.5, 0.0, 0.9], [0.2] * 3], sps) == [2, 3]


def test_low_confidence_gives_plain_decoding():
    assert schedule_verify([[0.002] * 7 for _ in range(3)], KNEE) == [0, 0, 0]


def test_budget_shrinks_with_load_and_vanishes_when_speculation_does_not_pay():
    conf = [0.95, 0.9, 0.9, 0.85, 0.8, 0.8, 0.7]
    means = []
    for r in (1, 2, 4, 8, 16, 32, 64):
        lengths = schedule_verify([conf] * r, KNEE)
        assert theta([conf] * r, lengths, KNEE) >= theta([conf] * r, [0] * r, KNEE)   # never slower
        means.append(sum(lengths) / r)
    assert means[0] == 7
    assert all(x >= y for x, y in zip(means, means[1:])), means
    assert means[2] < 7 and means[-3:] == [0, 0, 0], means


def test_rest_of_the_batch_counts_in_the_cost():
    conf = [[0.9] * 7] * 4
    assert schedule_verify(conf, KNEE) == [3, 3, 3, 3]
    # past the knee, 100 plain decoders emit one token per batch token: a draft must beat that (it cannot)
    assert schedule_verify(conf, KNEE, other_tokens=100, other_emitted=100) == [0] * 4
    # a 100-token prompt chunk emits nothing: a draft adds 1% to the step and 0.9 tokens to 4
    assert schedule_verify(conf, KNEE, other_tokens=100, other_emitted=0) == [7] * 4


confidence = st.one_of(st.floats(0.0, 1.0), st.sampled_from([0.5, 0.9, 0.99, 1.0]))
confidence_rows = st.lists(st.lists(confidence, min_size=0, max_size=7), min_size=1, max_size=8)


@st.composite
def decreasing_profiles(draw):
    """Non-increasing, with plateaus and cliffs (where a search past the first refusal finds more)."""
    rates = sorted(draw(st.lists(st.sampled_from([100.0, 90.0, 50.0, 45.0, 20.0, 10.0]), min_size=1, max_size=6)),
                   reverse=True)
    points = sorted(draw(st.lists(st.integers(1, 48), min_size=len(rates), max_size=len(rates), unique=True)))
    return SpsProfile(tuple(points), tuple(rates))


@settings(max_examples=200, deadline=None)
@given(confidence_rows, decreasing_profiles(), st.data())
def test_decisions_never_read_later_confidences(conf, sps, data):
    """Causality: rewriting any confidence past position ℓ_r + 1 of any request changes nothing."""
    lengths = schedule_verify(conf, sps)
    assert all(0 <= k <= len(row) for k, row in zip(lengths, conf))
    assert theta(conf, lengths, sps) >= theta(conf, [0] * len(conf), sps)
    changed = [row[: k + 1] + data.draw(st.lists(st.floats(0.0, 1.0), min_size=len(row[k + 1:]),
                                                 max_size=len(row[k + 1:])))
               for row, k in zip(conf, lengths)]
    assert schedule_verify(changed, sps) == lengths
    hopeful = [row[: k + 1] + [1.0] * len(row[k + 1:]) for row, k in zip(conf, lengths)]   # later drafts sure to pass
    assert schedule_verify(hopeful, sps) == lengths


def test_profile_interpolates_and_extrapolates_as_one_over_b():
    sps = SpsProfile.from_table({1: 100.0, 3: 80.0, 10: 10.0})
    assert sps.sps(1) == 100.0 and sps.sps(2) == 90.0 and sps.sps(20) == 5.0
    with pytest.raises(SchedulerError):
        SpsProfile.from_table({1: 0.0})
    with pytest.raises(SchedulerError):
        SpsProfile((2, 1), (1.0, 1.0))
    assert profile_points(12) == [1, 2, 4, 8, 12] and profile_points(8) == [1, 2, 4, 8]


def test_calibration_applies_per_position_temperatures():
    raw = [0.8, 0.8, 0.3]
    assert calibrate(raw, None) == raw
    cal = calibrate(raw, [1.0, 0.5])                     # t < 1 sharpens; position 3 has no temperature
    assert cal[0] == pytest.approx(0.8) and cal[1] == pytest.approx(16 / 17) and cal[2] == pytest.approx(0.3)


DRAFTER = Path(__file__).resolve().parents[2] / "models" / "drafters" / "stories260K-dspark"
PROMPTS = ["Once upon a time, there was a", "Tom had a big dog. The dog", "One day, Lily went to the",
           "The sun was hot and"]
GREEDY = SamplingParams(temperature=0.0, max_tokens=24)


@pytest.fixture(scope="module")
def engine():
    return SpecEngine.from_config(EngineConfig(max_num_seqs=32, num_local_blocks=1024, drafter=DRAFTER,
                                               speculation="dspark"))


def run(engine, prompts, speculation):
    return batch_outputs(engine, speculation, prompts, GREEDY, speculation)


def scheduled_mean(engine, prompts) -> tuple[float, list[list[int]]]:
    before = engine.stats()
    out = run(engine, prompts, "dspark")
    after = engine.stats()
    tokens = after["spec_scheduled_tokens_total"] - before["spec_scheduled_tokens_total"]
    return tokens / (after["spec_scheduled_requests_total"] - before["spec_scheduled_requests_total"]), out


def test_engine_greedy_is_exact_and_drafts_shrink_under_load(engine):
    engine.sps = KNEE                                     # injected: a measured CPU profile is noisy
    gamma = engine.config.num_speculative_tokens
    prompts = [PROMPTS[i % 4] + " " * (i // 4) for i in range(16)]
    want = run(engine, prompts, "none")
    busy, got = scheduled_mean(engine, prompts)
    assert got == want
    alone, _ = scheduled_mean(engine, prompts[:1])
    assert busy < gamma and busy < alone, (busy, alone)
    assert engine.stats()["spec_scheduled_tokens_mean"] <= gamma


def spec_counts(engine) -> tuple[int, int]:
    s = engine.stats()
    return s["spec_verifications_total"], s["spec_drafted_tokens_total"]


def test_fixed_schedule_verifies_every_draft(engine):
    """fixed = the scheduler on a flat profile (every draft with a chance pays): the same verifications."""
    fixed = SpecEngine(engine.model, engine.tokenizer, engine.config.model_copy(update={"spec_schedule": "fixed"}),
                       engine.source, engine.layout, engine.device, engine.model_name)
    fixed._proposers = engine._proposers                 # the same loaded drafter
    got = run(fixed, PROMPTS, "dspark")
    assert got == run(fixed, PROMPTS, "none")
    assert fixed.stats()["spec_scheduled_requests_total"] == 0 and fixed.sps is None
    engine.sps = SpsProfile.from_table({1: 100.0, 4096: 100.0})
    before = spec_counts(engine)
    run(engine, PROMPTS, "dspark")
    after = spec_counts(engine)
    assert (after[0] - before[0], after[1] - before[1]) == spec_counts(fixed)


def test_engine_measures_its_profile_once_and_tracks_the_step_overhead():
    """The profile is measured on the first scheduled step and kept; later scheduled steps fold their time
    outside the forward into ``overhead_s``. That overhead's sign is no timing claim this test can make: CI
    measured a profile while the machine was busy (192 forward steps/s at B = 1, 380 here when quiet), so
    every later step looked faster than its forward and the clamped average stayed 0. So after the measured
    run the rates are replaced by a ~1 ns forward with no overhead: every step's time is then overhead, and a
    positive average shows the samples were taken, whatever the machine's load."""
    e = SpecEngine.from_config(EngineConfig(max_num_seqs=4, max_num_batched_tokens=32, num_local_blocks=256,
                                            drafter=DRAFTER, speculation="dspark"))
    e.spec_gate = None                               # every step drafts: no wait on the gate's measurements
    run(e, PROMPTS[:2], "dspark")
    table = e.sps.to_table()
    assert tuple(table) == tuple(profile_points(32 + 4 * 7)) and all(s > 0 for s in table.values())
    e.sps = SpsProfile(e.sps.points, tuple(1e9 for _ in table))      # overhead_s = 0
    run(e, PROMPTS[:1], "dspark")
    assert e.sps.steps_per_s == tuple(1e9 for _ in table)            # measured once: not measured again
    assert e.sps.overhead_s > 0                      # the steps' samples were folded in
    stats = e.stats()
    assert stats["spec_sps_b1"] == 1e9 and stats["spec_step_overhead_seconds"] == e.sps.overhead_s


def test_an_injected_profile_is_kept_as_is(engine):
    engine.sps = KNEE
    run(engine, PROMPTS, "dspark")
    assert engine.sps is KNEE


def test_step_overhead_makes_verified_tokens_cheaper():
    conf = [[0.9] * 7] * 16
    assert sum(schedule_verify(conf, KNEE)) == 0
    assert sum(schedule_verify(conf, KNEE.with_overhead(0.01))) > 16     # 10 ms per step besides 1/SPS(B)
    assert KNEE.with_overhead(0.01).sps(1) == pytest.approx(1 / (0.01 + 0.01))
    with pytest.raises(SchedulerError):
        SpsProfile((1,), (1.0,), overhead_s=-1.0)
