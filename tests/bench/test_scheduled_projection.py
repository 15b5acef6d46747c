"""bench/scheduled_projection.py: the confidence scheduler replayed on recorded rounds, against one uniform k
for every request on the same draws, and its place in `bench sps-projection --scheduled`."""
from __future__ import annotations

import json

import pytest

from bench.__main__ import main as bench_main
from bench.scheduled_projection import batch_profile, recorded_rounds, replay, scheduled_against_uniform

GAMMA = 3
FLAT = [1e-3] * (GAMMA + 1)                      # verify costs the same at every k


def test_sure_drafts_are_all_verified_and_all_emitted():
    rounds = [([0.999] * GAMMA, GAMMA)]
    out = scheduled_against_uniform(rounds, FLAT, 4, 0.0, steps=5)
    assert out["scheduled"]["mean_length"] == GAMMA
    assert out["scheduled"]["speedup"] == pytest.approx(GAMMA + 1)
    assert out["best_uniform"]["k"] == GAMMA and out["best_uniform"]["speedup"] == pytest.approx(GAMMA + 1)


def test_hopeless_drafts_verify_nothing_and_pay_only_the_draft():
    rounds = [([0.001] * GAMMA, 0)]
    costly = [1e-3 * (1 + k) for k in range(GAMMA + 1)]
    out = replay(rounds, costly, 2, 0.5e-3, steps=5)
    assert out["mean_length"] == 0 and out["tokens_per_request_step"] == 1
    assert out["speedup"] == pytest.approx(1e-3 / 1.5e-3)     # the draft was paid; the gate would not draft


def test_emitted_tokens_are_the_accepted_prefix_of_what_is_verified_plus_one():
    rounds = [([0.9] * GAMMA, 1)]                 # one of the three drafts was accepted
    two = replay(rounds, FLAT, 1, 0.0, steps=3, lengths_of=lambda conf, _p: [2] * len(conf))
    zero = replay(rounds, FLAT, 1, 0.0, steps=3, lengths_of=lambda conf, _p: [0] * len(conf))
    assert two["tokens_per_request_step"] == 2 and zero["tokens_per_request_step"] == 1


def test_the_scheduler_beats_every_uniform_k_when_confidences_tell_the_rounds_apart():
    # half the rounds are sure and accepted whole, half hopeless; each verified token costs a lot at B = 8
    rounds = [([0.99] * GAMMA, GAMMA), ([0.02] * GAMMA, 0)] * 10
    steep = [1e-3 * (1 + 0.5 * k) for k in range(GAMMA + 1)]
    out = scheduled_against_uniform(rounds, steep, 8, 0.1e-3, steps=50, seed=3)
    assert out["scheduled"]["speedup"] > 1.0 > out["best_uniform"]["speedup"]     # no single k pays here
    assert 0.5 * GAMMA - 0.6 < out["scheduled"]["mean_length"] < 0.5 * GAMMA + 0.6   # sure rounds only
    assert scheduled_against_uniform(rounds, steep, 8, 0.1e-3, steps=50, seed=3) == out   # seeded


def test_recorded_rounds_are_calibrated_with_the_sts_temperatures_and_the_profile_has_the_draft():
    raw = {"confidence": [[0.8, 0.5]], "accepted": [1], "sts_temperatures": [2.0, 1.0]}
    [(conf, accepted)] = recorded_rounds(raw)
    assert conf[0] == pytest.approx(1 / (1 + (0.2 / 0.8) ** 0.5)) and conf[1] == pytest.approx(0.5) and accepted == 1
    assert recorded_rounds({**raw, "sts_temperatures": None})[0][0] == [0.8, 0.5]
    profile = batch_profile([2e-3, 3e-3], 4, 1e-3)
    assert profile.points == (4, 8) and 1 / profile.sps(4) == pytest.approx(3e-3)
    with pytest.raises(ValueError):
        replay([], FLAT, 1, 0.0)


def test_sps_projection_replays_the_scheduler_on_recorded_rounds(tmp_path):
    first = tmp_path / "measured"
    assert bench_main(["sps-projection", "--shape", "tiny", "--batches", "1,2", "--context", "16", "--gamma", "2",
                       "--repeats", "1", "--out", str(first)]) == 0
    records = {"confidence": [[0.95, 0.9], [0.05, 0.5]] * 4, "accepted": [2, 0] * 4, "sts_temperatures": None}
    acc = tmp_path / "w.json"
    acc.write_text(json.dumps({"tau": 2.0, "rounds": 8, "acceptance_by_position": [0.5, 1.0],
                               "reached_by_position": [8, 4], "accepted_by_position": [4, 4],
                               "draft_cost_fraction": 0.2, "round_records": records}))
    out = tmp_path / "o"
    assert bench_main(["sps-projection", "--timings", str(first / "sps_projection.json"), "--acceptance", str(acc),
                       "--draft-fraction", "0.2", "--scheduled", "--scheduled-draws", "40", "--out", str(out)]) == 0
    result = json.loads((out / "sps_projection.json").read_text())
    [sched] = result["projection"]["scheduled"]                # one table: the one fraction given
    assert sched["basis"] == "f = 0.2"
    verify = {int(b): [t / 1e3 for t in v] for b, v in result["verify_ms"].items()}
    markov = {int(b): m["loop_ms"] / 1e3 for b, m in result["markov"].items()}
    for b in (1, 2):
        draft_s = 0.2 * verify[b][-1] + markov[b]            # f × a full verify + the loop
        assert sched["draft_ms"][str(b)] == pytest.approx(1e3 * draft_s)
        want = scheduled_against_uniform(recorded_rounds(records), verify[b], b, draft_s, 40 // b)   # 40 draws
        assert sched["by_source"]["w"][str(b)] == json.loads(json.dumps(want))     # the same seeded replay
    assert "The confidence scheduler replayed" in (out / "sps_projection.md").read_text()
    bare = tmp_path / "bare.json"
    bare.write_text(json.dumps({"tau": 2.0, "rounds": 8, "acceptance_by_position": [0.5, 1.0]}))
    with pytest.raises(SystemExit, match="keep-rounds"):
        bench_main(["sps-projection", "--timings", str(first / "sps_projection.json"), "--acceptance", str(bare),
                    "--scheduled", "--out", str(out)])


def test_a_measured_round_prices_the_replay_first(tmp_path):
    first = tmp_path / "measured"
    assert bench_main(["sps-projection", "--shape", "tiny", "--batches", "1,2", "--context", "16", "--gamma", "2",
                       "--repeats", "1", "--out", str(first)]) == 0
    acc = tmp_path / "w.json"
    acc.write_text(json.dumps({"tau": 2.0, "rounds": 2, "acceptance_by_position": [0.5, 1.0],
                               "round_records": {"confidence": [[0.9, 0.9], [0.1, 0.5]], "accepted": [2, 0],
                                                 "sts_temperatures": None}}))
    parts = ("block_forward_graph", "markov_graph", "absorb_graph")
    rounds = tmp_path / "draft_round-tiny.json"
    rounds.write_text(json.dumps({"b2_greedy": {p: {"total_ms_p50": 0.1} for p in parts}}))
    out = tmp_path / "o"
    assert bench_main(["sps-projection", "--timings", str(first / "sps_projection.json"), "--acceptance", str(acc),
                       "--draft-round", str(rounds), "--draft-fraction", "0.3", "--scheduled",
                       "--scheduled-draws", "10", "--out", str(out)]) == 0
    measured, assumed = json.loads((out / "sps_projection.json").read_text())["projection"]["scheduled"]
    assert measured["basis"] == "the measured round" and measured["draft_ms"] == pytest.approx({"2": 0.3})
    assert assumed["basis"] == "f = 0.3" and set(assumed["draft_ms"]) == {"1", "2"}
