"""bench.draft_step_cost: a drafting step's time and tokens against `none`'s plain step, cell by cell."""
from __future__ import annotations

import gzip
import json

import pytest

from bench.draft_step_cost import cell_costs, cost, main
from tests.bench.test_step_split import NONE, DRAFTING, run


def test_a_drafting_step_is_priced_in_plain_steps_of_the_same_repeat():
    c = cost(NONE, DRAFTING)
    plain_ms, plain_tok = 412.7 / 179, 2840 / 179
    assert c["steps"] == 40 and c["draft_ms"] == pytest.approx(264.0 / 40) and c["plain_ms"] == pytest.approx(plain_ms)
    assert c["step_ratio"] == pytest.approx((264.0 / 40) / plain_ms)
    assert c["token_ratio"] == pytest.approx((2640 / 40) / plain_tok)
    # 6.6 ms a drafting step = 2.86 plain steps, emitting 66 tokens = 4.16 plain steps' 15.9: 0.69 a token
    assert c["per_token"] == pytest.approx(c["step_ratio"] / c["token_ratio"]) and 0.68 < c["per_token"] < 0.70
    assert cost(NONE, NONE) is None                      # a repeat that never drafted has no price


def test_cells_keep_only_the_repeats_that_drafted(tmp_path, capsys):
    resting = run(530.0, (16, 112.0, 232), (179, 413.0, 2840))
    cell = {"rows": {"none": {"runs": [NONE, NONE]}, "dspark": {"runs": [DRAFTING, resting]}}}
    result = {"workloads": {"extraction.eval": {"16": cell}, "coding.eval": {"16": {
        "rows": {"none": {"runs": [NONE]}, "dspark": {"runs": [resting]}}}}}}
    got = cell_costs([result], "dspark")
    assert [(w, c, len(s)) for w, c, s in got] == [("extraction.eval", 16, 1)]
    path = tmp_path / "speedup.json.gz"
    with gzip.open(path, "wt") as f:
        json.dump(result, f)
    assert main([str(path)]) == 0
    out = capsys.readouterr().out
    assert "| extraction.eval | 16 | 1 | 40.0 | 6.60 | 2.31 | 2.86 | 4.16 | 0.69 |" in out and "coding" not in out
    with pytest.raises(SystemExit):
        main([str(path), "--row", "eagle3"])


def test_phases_put_a_drafting_phases_first_steps_beside_its_later_ones(tmp_path, capsys):
    first = {"steps": 2, "tokens": 120, "ms": 26.0, "schedule_ms": 9.0, "gate_ms": 0.6, "propose_ms": 7.5,
             "forward_ms": 15.0}
    later = {"steps": 38, "tokens": 2520, "ms": 238.0, "schedule_ms": 76.0, "gate_ms": 3.8, "propose_ms": 57.0,
             "forward_ms": 150.0}
    probing = dict(DRAFTING, draft_phases={"draft_first": first, "draft_later": later})
    probe_only = dict(DRAFTING, draft_phases={"draft_first": dict(first, steps=1, ms=14.0)})
    cell = {"rows": {"none": {"runs": [NONE, NONE, NONE]}, "dspark": {"runs": [probing, probe_only, NONE]}}}
    path = tmp_path / "speedup.json"
    path.write_text(json.dumps({"workloads": {"extraction.eval": {"32": cell}}}))
    assert main([str(path), "--phases"]) == 0
    # first steps: 3 over 2 repeats, (26 + 14) / 3 ms; later: 38 in one repeat of 2 that drafted
    assert ("| extraction.eval | 32 | 2 | 1.5 | 13.33 (6.00 [0.40, 5.00] + 10.00) | 19.0 | 6.26 (2.00 [0.10, 1.50] + 3.95) |"
            in capsys.readouterr().out)
    # a record from before the gate / propose split (session 42's runs): no split printed, not a zero
    old = {k: v for k, v in first.items() if k not in ("gate_ms", "propose_ms")}
    cell["rows"]["dspark"]["runs"] = [dict(DRAFTING, draft_phases={"draft_first": old}), NONE, NONE]
    path.write_text(json.dumps({"workloads": {"extraction.eval": {"32": cell}}}))
    assert main([str(path), "--phases"]) == 0
    assert "| 13.00 (4.50 [-] + 7.50) |" in capsys.readouterr().out
    path.write_text(json.dumps({"workloads": {"extraction.eval": {"32": {"rows": {
        "none": {"runs": [NONE]}, "dspark": {"runs": [DRAFTING]}}}}}}))
    assert main([str(path), "--phases"]) == 0
    assert "No repeat of dspark recorded draft_phases" in capsys.readouterr().out


def test_kinds_split_each_step_kind_into_schedule_forward_and_after_the_sync(tmp_path, capsys):
    plain = {"steps": 10, "ms": 20.0, "schedule_ms": 2.0, "forward_ms": 17.5}
    capture = {"steps": 2, "ms": 5.0, "schedule_ms": 0.8, "forward_ms": 3.6}
    draft = {"steps": 4, "ms": 14.0, "schedule_ms": 5.0, "forward_ms": 7.6}
    base = dict(NONE, step_kinds={"plain": plain})
    row = dict(DRAFTING, step_kinds={"plain": plain, "capture": capture, "draft": draft})
    resting = dict(DRAFTING, step_kinds={"plain": dict(plain, steps=30, ms=60.0, schedule_ms=6.0, forward_ms=52.5)})
    cell = {"rows": {"none": {"runs": [base, base]}, "dspark": {"runs": [row, resting]}}}
    path = tmp_path / "speedup.json"
    path.write_text(json.dumps({"workloads": {"coding.eval": {"4": cell}}}))
    assert main([str(path), "--kinds"]) == 0
    # plain over both repeats (40 steps), capture and draft from the one repeat that took them
    assert ("| coding.eval | 4 | 2.00 (0.20 + 1.75 + 0.05) | 2.00 (0.20 + 1.75 + 0.05) | 2.50 (0.40 + 1.80 + 0.30) "
            "| 3.50 (1.25 + 1.90 + 0.35) |" in capsys.readouterr().out)
    cell["rows"]["dspark"]["runs"] = [resting, resting]
    path.write_text(json.dumps({"workloads": {"coding.eval": {"4": cell}}}))
    assert main([str(path), "--kinds"]) == 0
    assert "| 2.00 (0.20 + 1.75 + 0.05) | - | - |" in capsys.readouterr().out
