"""bench.measuring_cost: auto runs against their main method's row, split by measuring steps' share."""
from __future__ import annotations

import json

import pytest

from bench.measuring_cost import main, measure_steps, split


def run(tokens: int, wall: float, steps: int = 100, methods: dict | None = None, reasons: dict | None = None) -> dict:
    return {"tokens": tokens, "wall_s": wall, "steps": steps, "auto_methods": methods or {},
            "gate_drafted_by": reasons or {}}


def result() -> dict:
    """c = 16: a run of mostly dspark with 30 measuring steps (slow), one mostly ngram with 2 (level);
    c = 1: one run with none."""
    heavy = {"rows": {"dspark": {"runs": [run(1000, 1.0), run(1000, 1.0)]},
                      "ngram-gated": {"runs": [run(1000, 1.0), run(1000, 1.0)]},
                      "auto": {"runs": [run(800, 1.0, methods={"dspark": 60, "ngram": 4, "measuring": 4},
                                            reasons={"measure": 30, "class": 1}),
                                        run(1000, 1.0, methods={"dspark": 3, "ngram": 61}, reasons={"measure": 2})]}}}
    light = {"rows": {"dspark": {"runs": [run(500, 1.0)]}, "ngram-gated": {"runs": [run(400, 1.0)]},
                      "auto": {"runs": [run(400, 1.0, methods={"ngram": 8})]}}}
    return {"workloads": {"creative.eval": {"1": light, "16": heavy}}}


def test_runs_split_by_the_share_of_measuring_steps_against_their_main_methods_row():
    groups = split([result()], {"dspark": "dspark", "ngram": "ngram-gated"}, 0.10)
    assert groups[("c >= 16", True)] == [pytest.approx(0.8)]       # mostly dspark, 30% measuring steps
    assert groups[("c >= 16", False)] == [pytest.approx(1.0)]      # mostly ngram, 2%
    assert groups[("c = 1", False)] == [pytest.approx(1.0)]        # ngram against ngram-gated's 400
    assert ("c = 1", True) not in groups


def test_old_runs_count_their_measuring_steps_under_class():
    assert measure_steps({"gate_drafted_by": {"class": 7}}) == 7
    assert measure_steps({"gate_drafted_by": {"class": 7, "measure": 2}}) == 2


def test_the_command_prints_the_table_and_refuses_results_without_auto(tmp_path, capsys):
    path = tmp_path / "speedup.json"
    path.write_text(json.dumps(result()))
    assert main([str(path)]) == 0
    out = capsys.readouterr().out
    assert "| c >= 16 | 1.000 (1) | 0.800 (1) |" in out and "| c = 1 | 1.000 (1) | – |" in out
    empty = tmp_path / "none.json"
    empty.write_text(json.dumps({"workloads": {"w": {"1": {"rows": {"dspark": {"runs": []}}}}}}))
    assert main([str(empty)]) == 2
    assert "no auto run" in capsys.readouterr().err
    missing = tmp_path / "missing.json"
    bad = result()
    del bad["workloads"]["creative.eval"]["16"]["rows"]["ngram-gated"]
    missing.write_text(json.dumps(bad))
    assert main([str(missing)]) == 2
    assert "no 'ngram-gated' row" in capsys.readouterr().err


def test_the_gap_splits_into_the_mixing_against_the_blend_and_the_choice_against_the_faster_row():
    from bench.measuring_cost import mixing
    groups = mixing([result()], {"dspark": "dspark", "ngram": "ngram-gated"}, 0.15)
    # c = 16: both rows 1,000 tok/s, so the blend is 1,000 and the choice costs nothing; minority 4/64 and 3/64
    assert groups[("c >= 16", False)] == [pytest.approx((0.8, 1.0)), pytest.approx((1.0, 1.0))]
    # c = 1: all 8 requests ngram: the blend is ngram-gated's 400, against dspark's faster 500
    assert groups[("c = 1", False)] == [pytest.approx((1.0, 0.8))]
    half = result()
    half["workloads"]["creative.eval"]["1"]["rows"]["auto"]["runs"] = [run(400, 1.0, methods={"dspark": 4, "ngram": 4})]
    mixed = mixing([half], {"dspark": "dspark", "ngram": "ngram-gated"}, 0.15)
    blend = 1 / (0.5 / 500 + 0.5 / 400)          # 444.4 tok/s: the same requests, each at its own row's rate
    assert mixed[("c = 1", True)] == [pytest.approx((400 / blend, blend / 500))]


def test_the_command_prints_the_mixing_table_too(tmp_path, capsys):
    path = tmp_path / "speedup.json"
    path.write_text(json.dumps(result()))
    assert main([str(path), "--mixed", "0.05"]) == 0
    out = capsys.readouterr().out
    assert "| c >= 16 | 1.000, 1.000 (1) | 0.800, 1.000 (1) |" in out      # minority 3/64 ≤ 5% < 4/64
    assert "| c = 1 | 1.000, 0.800 (1) | – |" in out
