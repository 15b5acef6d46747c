"""bench.gate_trace: one gate cell's recorded reports as a table, with the drafting step time they imply."""
from __future__ import annotations

import json

import pytest

from bench.gate_trace import implied_step_ms, main, reports
from bench.speedup_pool import PoolError

# [drafted, tokens, ms, sequences, sample, reason, predicted tokens a sequence, drafting tok/s, plain tok/s]
EXPLORE = [0, 4, 2.4, 4, 1, "explore", None, None, None]
PROBE = [1, 9, 5.99, 4, 1, "probe", None, 0.0, 1702.9]
REST = [0, 4, 1.95, 4, 1, "winner", 3.104, 1898.2, 1982.7]
RESULT = {"gate_trace": {"dspark_b4": [EXPLORE, PROBE, REST]},
          "workloads": {"extraction.eval": {"4": {"gate_recent": {"dspark_b4": [REST]},
                                                  "gate_recent_by_row": {"ngram-gated": {"ngram_gated_b4": [PROBE]}}}}}}


def test_the_implied_step_is_what_the_prediction_charges_a_drafting_step():
    assert implied_step_ms(REST) == pytest.approx(1e3 * 3.104 * 4 / 1898.2)     # 6.54 ms
    assert implied_step_ms(EXPLORE) is None and implied_step_ms(PROBE) is None


def test_first_reports_latest_ones_and_a_rows_own_gate(tmp_path, capsys):
    assert reports(RESULT, "dspark_b4") == [EXPLORE, PROBE, REST]
    assert reports(RESULT, "dspark_b4", "extraction.eval:4") == [REST]
    assert reports(RESULT, "ngram_gated_b4", "extraction.eval:4", "ngram-gated") == [PROBE]
    path = tmp_path / "speedup.json"
    path.write_text(json.dumps(RESULT))
    assert main([str(path), "--cell", "dspark_b4"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[2] == "| 0 | no | 4 | 2.40 | 4 | yes | explore | - | - | - | - |"
    assert out[3] == "| 1 | yes | 9 | 5.99 | 4 | yes | probe | - | 0 | 1703 | - |"
    assert out[4] == "| 2 | no | 4 | 1.95 | 4 | yes | winner | 3.10 | 1898 | 1983 | 6.54 |"


@pytest.mark.parametrize("args, message", [
    (("dspark_b8",), "no cell 'dspark_b8' in the run's first reports (gate_trace); cells: dspark_b4"),
    (("dspark_b4", "coding.eval:4"), "no cell 'coding.eval:4'"),
    (("dspark_b4", None, "ngram-gated"), "--row needs --at"),
    (("dspark_b4", "extraction.eval:4", "eagle3"), "no gate reports in extraction.eval:4's latest reports of row"),
])
def test_a_missing_cell_or_row_is_a_clear_error(args, message):
    with pytest.raises(PoolError, match=message.replace("(", r"\(").replace(")", r"\)")):
        reports(RESULT, *args)


TAIL = [0, 4, 1.95, 4, 1, "winner", 1.0, 611.5, 1982.7]     # a run's last step: the predictions capped


def _cell(recent, g7_steps, scheduled=1.0, fixed=1.4, tau=2.3):
    runs = [{"step_kinds": {"draft": {"steps": n, "ms": n * ms}}} for n, ms in g7_steps]
    return {"gate_recent": {"dspark_b4": recent},
            "rows": {"dspark": {"throughput_ratio": {"p50": scheduled}},
                     "dspark-g7": {"runs": runs, "tau": tau, "throughput_ratio": {"p50": fixed}}}}


def test_prices_put_each_cells_last_decision_beside_the_fixed_rows_drafting_step(tmp_path, capsys):
    """``prices``: per (workload, concurrency) the latest reports with a prediction at that load's bucket (c = 5
    reads b4), how many drafted, their median prediction and implied drafting step, and the fixed-γ row's
    median drafting step over its runs; cells without a decision or without that row are left out."""
    from bench.gate_trace import prices

    result = {"workloads": {
        "extraction.eval": {"4": _cell([REST, EXPLORE, REST, TAIL], [(10, 3.0), (10, 4.0), (20, 5.0)])},
        "coding.eval": {"5": _cell([PROBE, REST], [(8, 4.0)], scheduled=0.97, fixed=1.1),
                        "8": _cell([REST], [(8, 4.0)])},             # no b8 reports: left out
        "knowledge.eval": {"4": {"gate_recent": {"dspark_b4": [REST]}, "rows": {}}}}}   # no fixed row
    got = prices(result)
    assert [(e["workload"], e["concurrency"]) for e in got] == [("extraction.eval", 4), ("coding.eval", 5)]
    first = got[0]
    assert (first["drafted"], first["reports"]) == (0, 3) and first["predicted_tokens"] == 3.104   # not the tail's
    assert first["implied_ms"] == pytest.approx(6.541, abs=1e-3) and first["against_ms"] == 4.0
    assert first["over"] == pytest.approx(6.541 / 4.0, abs=1e-3)
    assert (got[1]["ratio"], got[1]["against_ratio"], got[1]["against_tau"]) == (0.97, 1.1, 2.3)
    path = tmp_path / "speedup.json"
    path.write_text(json.dumps(result))
    assert main([str(path), "--prices"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[2] == "| extraction.eval | 4 | 0 of 3 | 3.10 | 6.54 | 4.00 | 1.64 | 2.30 | 1.00 | 1.40 |"
    # a window that still holds the cell run before (a long --gate-trace-steps) is read from the new reports on
    later = {"workloads": {"extraction.eval": {"4": _cell([PROBE, REST], [(8, 4.0)])},
                           "support.eval": {"4": _cell([PROBE, REST, REST, TAIL], [(8, 4.0)])}}}
    assert [(e["drafted"], e["reports"]) for e in prices(later)] == [(0, 1), (0, 2)]   # not 3: REST, TAIL only
    with pytest.raises(SystemExit):
        main([str(path)])                                  # neither --cell nor --prices
    with pytest.raises(SystemExit):
        main([str(path), "--prices", "--against", "eagle3"])   # no cell has that row


def test_new_reports_are_what_a_window_holds_beyond_the_cell_run_before():
    from bench.gate_trace import new_reports

    a, b, c, d = ([i] for i in range(4))
    assert new_reports([], [a, b]) == [a, b]
    assert new_reports([a, b], [a, b, c]) == [c]                 # the window grew
    assert new_reports([a, b, c], [b, c, d]) == [d]              # it slid by one (its length is the limit)
    assert new_reports([a, b], [c, d]) == [c, d]                 # it slid past everything held before
    assert new_reports([a, b], [a, b]) == []


def test_calibration_puts_each_cells_predictions_beside_what_its_drafting_steps_emitted(tmp_path, capsys):
    """Per (workload, concurrency): the drafting steps decided on a prediction among the reports new in that
    cell (the window of the cell before left out), predicted against emitted tokens a sequence, as means and
    their ratio; exploring steps (no prediction), warm-ups and resting steps left out."""
    from bench.gate_trace import calibration

    first = [EXPLORE, [1, 12, 5.0, 4, 1, "winner", 3.0, 2000.0, 1900.0],   # emitted 3.0 of 3.0 predicted
             [1, 8, 5.0, 4, 0, "winner", 3.0, 2000.0, 1900.0]]            # a warm-up: no sample
    later = first + [[1, 6, 6.0, 4, 1, "probe", 3.0, 1500.0, 1900.0],     # 1.5 of 3.0
                     [1, 10, 6.0, 4, 1, "winner", 2.0, 1500.0, 1900.0],   # 2.5 of 2.0
                     REST]
    result = {"workloads": {"coding.eval": {"4": {"gate_recent": {"dspark_b4": first}}},
                            "support.eval": {"4": {"gate_recent": {"dspark_b4": later}},
                                             "1": {"gate_recent": {"dspark_b1": [EXPLORE]}}}}}
    got = calibration(result)
    assert [(e["workload"], e["concurrency"], e["drafted"]) for e in got] == [("coding.eval", 4, 1),
                                                                               ("support.eval", 4, 2)]
    assert got[0]["emitted_over_predicted"] == pytest.approx(1.0)
    assert (got[1]["predicted"], got[1]["emitted"]) == (pytest.approx(2.5), pytest.approx(2.0))
    assert got[1]["emitted_over_predicted"] == pytest.approx(4.0 / 5.0)
    path = tmp_path / "speedup.json"
    path.write_text(json.dumps(result))
    assert main([str(path), "--calibration"]) == 0
    assert capsys.readouterr().out.splitlines()[3] == "| support.eval | 4 | 2 | 2.50 | 2.00 | 0.80 |"
    with pytest.raises(SystemExit):
        main([str(path), "--calibration", "--prices"])


def test_the_calibration_replay_rests_the_winner_steps_whose_predictions_ran_high(tmp_path, capsys):
    """Three drafting steps taken as the winner at 1.1x plain decoding's predicted rate, each emitting half
    the 3 tokens a sequence predicted: the first is drafted at the factor 1; after it the factor is
    (0.5 + 5) / (1 + 5) = 0.917 and 1.1 × 0.917 < 1.03, so a calibrated gate would rest the other two. A probe
    drafts whatever the factor and is counted apart (it calibrates the factor as any drafting step does); steps that emit what they predict keep the factor at 1."""
    from bench.gate_trace import replay_calibration

    high = [1, 6, 5.0, 4, 1, "winner", 3.0, 1100.0, 1000.0]
    probe = [1, 6, 5.0, 4, 1, "probe", 3.0, 1100.0, 1000.0]
    right = [1, 12, 5.0, 4, 1, "winner", 3.0, 1100.0, 1000.0]
    result = {"workloads": {"support.eval": {"32": {"gate_recent": {"dspark_b32": [high, high, high, probe]}}},
                            "extraction.eval": {"4": {"gate_recent": {"dspark_b4": [right, right, right]}}}}}
    support, extraction = replay_calibration(result)
    assert (support["winner_steps"], support["would_rest"], support["probes"]) == (3, 2, 1)
    assert support["factor"] < 0.917
    assert (extraction["winner_steps"], extraction["would_rest"], extraction["factor"]) == (3, 0, pytest.approx(1.0))
    path = tmp_path / "speedup.json"
    path.write_text(json.dumps(result))
    assert main([str(path), "--replay-calibration"]) == 0
    assert "| support.eval | 32 | 3 | 2 | 1 |" in capsys.readouterr().out


def test_the_steady_replay_drafts_the_rests_a_probes_opening_priced_out(tmp_path, capsys):
    """A phase that opens at 6 ms a step and settles at 4, a rest, a 3-step probe at 6 ms, rests again. The
    first rest (before the probe) would rest either way: both arms hold the same steps, the first phase's
    openings taken as measured (no steady step yet). After the probe the measured arm is mostly its 6 ms
    steps, the steady-priced one reads them at 6 / (the opening ratio, 1.5) = 4 ms (1.19x the measured arm's
    rate): a rest predicted at 0.9 of plain decoding would have drafted (0.9 × 1.19 > 1.03); one predicted at
    0.5 would not. Warm-ups are no
    sample; probes and exploring steps are not rests."""
    from bench.gate_trace import replay_steady

    def d(ms, reason="winner"):
        return [1, 8, ms, 4, 1, reason, 2.0, 1500.0, 1000.0]

    def rest(predicted):
        return [0, 4, 2.0, 4, 1, "winner", 2.0, predicted, 1000.0]

    window = ([d(6.0, "explore")] * 3 + [d(4.0)] * 5 + [rest(900.0)] + [[0, 4, 2.0, 4, 0, "winner", 2.0, 900.0,
               1000.0]] + [d(6.0, "probe")] * 3 + [rest(900.0), rest(500.0), [0, 4, 2.0, 4, 1, "probe", 2.0, 900.0, 1000.0]])
    result = {"workloads": {"support.eval": {"4": {"gate_recent": {"dspark_b4": window}}}}}
    (got,) = replay_steady(result)
    assert (got["winner_rests"], got["would_draft"]) == (3, 1)
    assert got["opening"] == pytest.approx(1.5)
    path = tmp_path / "speedup.json"
    path.write_text(json.dumps(result))
    assert main([str(path), "--replay-steady"]) == 0
    assert "| support.eval | 4 | 3 | 1 | 1.50 |" in capsys.readouterr().out


def test_phase_steps_place_each_drafting_step_in_its_phase_at_a_full_batch(tmp_path, capsys):
    """A rest ends a phase; steps of a draining batch (fewer than 90% of the cell's concurrency) and warm-ups
    are left out; the 4th step of a phase and later ones pool; the cells come in bucket order."""
    from bench.gate_trace import phase_steps

    def d(ms, n=4, used=1):
        return [1, 2 * n, ms, n, used, "winner", 2.0, 1000.0, 900.0]

    rest = [0, 4, 2.0, 4, 1, "winner", 2.0, 800.0, 900.0]
    window = [d(5.0), d(4.0), d(3.5), d(3.0), d(3.2), rest, d(6.0, used=0), d(4.4), d(9.0, n=2), rest, d(5.2)]
    result = {"workloads": {"coding.eval": {"4": {"gate_recent": {"dspark_b4": window}},
                                            "1": {"gate_recent": {"dspark_b1": [d(2.0, n=1)]}}}}}
    b1, b4 = phase_steps(result)
    assert b1 == {"cell": "dspark_b1", "steps": {1: (2.0, 1)}}
    assert b4["steps"] == {1: (5.1, 2), 2: (4.2, 2), 3: (3.5, 1), 4: (3.1, 2)}
    path = tmp_path / "speedup.json"
    path.write_text(json.dumps(result))
    assert main([str(path), "--phase-steps"]) == 0
    assert "| dspark_b4 | 5.10 (2) | 4.20 (2) | 3.50 (1) | 3.10 (2) |" in capsys.readouterr().out


def test_phase_tokens_read_the_openings_of_every_phase_and_of_the_phases_that_lasted(tmp_path, capsys):
    """Two phases on support: one that stopped after 2 steps (1 token a sequence each), one that lasted 4
    (2, 3, 3, 3): over every phase the 1st steps average 1.5 tokens a sequence, within the lasting phase
    2, against 3 at the 3rd place and later. Warm-ups and steps without sequences count toward a phase's
    length but not its tokens; a rest ends a phase, and so does the window's end."""
    from bench.gate_trace import phase_tokens

    def d(tokens, n=4, used=1):
        return [1, tokens * n, 4.0, n, used, "winner", 2.0, 1000.0, 900.0]

    rest = [0, 4, 2.0, 4, 1, "winner", 2.0, 800.0, 900.0]
    window = [d(1), d(1), rest, d(2), d(3), d(9, used=0), d(3), d(0, n=0), rest, d(5)]
    result = {"workloads": {"support.eval": {"4": {"gate_recent": {"dspark_b4": window}}}}}
    (got,) = phase_tokens(result, longest=3, lasting=4)
    assert (got["phases"], got["lasted"]) == (3, 1)
    assert got["all"] == {1: (pytest.approx(8 / 3), 3), 2: (2.0, 2), 3: (3.0, 1)}
    assert got["lasting"] == {1: (2.0, 1), 2: (3.0, 1), 3: (3.0, 1)}
    path = tmp_path / "speedup.json"
    path.write_text(json.dumps(result))
    assert main([str(path), "--phase-tokens", "--lasting", "4"]) == 0
    out = capsys.readouterr().out
    # the table's four places: the warm-up held the 3rd, so that place has no step
    assert "| support.eval | every phase | 3 | 2.67 (3) | 2.00 (2) | - | 3.00 (1) |" in out
    assert "| support.eval | ≥ 4 steps | 1 | 2.00 (1) | 3.00 (1) | - | 3.00 (1) |" in out


def test_a_row_without_a_gate_of_its_own_is_refused_by_name(tmp_path, capsys):
    """The default row runs on the engine's gate, so ``--row dspark`` found no reports and said only that no
    step qualified (session 55); now it names the rows that kept their own gates."""
    path = tmp_path / "speedup.json"
    path.write_text(json.dumps(RESULT))
    with pytest.raises(SystemExit):
        main([str(path), "--phase-steps", "--row", "dspark"])
    assert "row 'dspark' ran no gate of its own in this run (rows that did: ngram-gated)" in capsys.readouterr().err


def test_reasons_split_a_cells_drafting_steps_by_why_they_drafted_beside_the_fixed_rows_tau(tmp_path, capsys):
    """Per (workload, concurrency): tokens a sequence of the drafting steps by reason (warm-ups and rests
    left out), beside the fixed-γ row's τ; a cell without that row shows '-'."""
    from bench.gate_trace import reasons

    def d(tokens, reason, used=1):
        return [1, tokens, 3.0, 1, used, reason, 2.0, 700.0, 500.0]

    rest = [0, 1, 2.0, 1, 1, "winner", 1.5, 400.0, 500.0]
    window = [d(4, "explore"), d(2, "probe"), d(1, "probe"), d(9, "probe", used=0), d(3, "winner"), d(4, "winner"),
              rest]
    result = {"workloads": {"knowledge.eval": {"1": {"gate_recent": {"dspark_b1": window},
                                                     "rows": {"dspark-g7": {"tau": 1.57}}}}}}
    (got,) = reasons(result)
    assert got["reasons"] == {"explore": (4.0, 1), "probe": (1.5, 2), "winner": (3.5, 2)}
    assert got["against_tau"] == 1.57
    path = tmp_path / "speedup.json"
    path.write_text(json.dumps(result))
    assert main([str(path), "--reasons"]) == 0
    assert "| knowledge.eval | 1 | 4.00 (1) | - | 1.50 (2) | 3.50 (2) | 1.57 |" in capsys.readouterr().out
    assert main([str(path), "--reasons", "--against", "ngram"]) == 0
    assert "| knowledge.eval | 1 | 4.00 (1) | - | 1.50 (2) | 3.50 (2) | - |" in capsys.readouterr().out


def test_the_class_replay_moves_each_winner_decision_by_the_two_starts_difference(tmp_path, capsys):
    """A class that drafted a good stretch (3 tokens a step, 30 steps) and then a bad tail (1 token, 12 steps):
    the default record (0.95) holds mostly the tail, the long one (0.995) both; a rest predicted at 1.5
    tokens and 0.95 of plain decoding's rate would draft on the long record's start, a rest predicted at
    0.5 of it would not. Probe steps alone (1 token here) move it down instead: the winner's drafting step
    after the rests would rest."""
    from bench.gate_trace import replay_class

    def d(tokens, reason="winner"):
        return [1, tokens, 3.0, 1, 1, reason, 2.0, 700.0, 500.0]

    def rest(rate):
        return [0, 1, 2.0, 1, 1, "winner", 1.5, rate, 500.0]

    window = ([d(3)] * 30 + [d(1)] * 10 + [d(1, "probe")] * 2 + [rest(475.0), rest(250.0)]
              + [[1, 2, 3.0, 1, 1, "winner", 2.0, 560.0, 500.0]])
    result = {"workloads": {"support.eval": {"1": {"gate_recent": {"dspark_b1": window}}}}}
    (long,) = replay_class(result)
    assert (long["winner_rests"], long["would_draft"]) == (2, 1)
    assert long["class"] < 2.1 < long["other"]
    (probes,) = replay_class(result, prior="probes")
    assert (probes["winner_rests"], probes["would_draft"]) == (2, 0)
    assert probes["other"] == pytest.approx(1.0) and (probes["winner_drafts"], probes["would_rest"]) == (40, 1)
    path = tmp_path / "speedup.json"
    path.write_text(json.dumps(result))
    assert main([str(path), "--replay-class"]) == 0
    assert "| support.eval | 1 | 2 | 1 |" in capsys.readouterr().out
    with pytest.raises(PoolError, match="unknown class prior"):
        replay_class(result, prior="recent")
