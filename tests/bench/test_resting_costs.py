"""bench.resting_costs: a gated row's resting repeats against `none`, phase by phase."""
from __future__ import annotations

import json

import pytest

from bench.resting_costs import costs, main, resting_pairs


def run(wall, schedule, drafted=0, prompt=(10, 5.0), captures=0):
    return {"wall_s": wall, "phase_ms_per_step": {"schedule": schedule, "forward": 2.0},
            "gate_drafted_by": {"probe": drafted}, "step_kinds": {"prompt": {"steps": prompt[0], "ms": prompt[1]},
                                                                  "capture": {"steps": captures}}}


def result() -> dict:
    none = [run(1.00, 0.20), run(1.00, 0.20), run(1.00, 0.20)]
    dspark = [run(1.02, 0.23, prompt=(10, 5.5), captures=1),   # rested: +30 µs schedule, +0.05 ms a prompt step
              run(1.01, 0.24, drafted=1),                        # one probe step: still counted at the default
              run(0.80, 0.90, drafted=6)]                        # drafted: not a resting repeat
    return {"workloads": {"coding.eval": {"32": {"rows": {"none": {"runs": none}, "dspark": {"runs": dspark}}}}}}


def test_only_resting_repeats_count_and_each_pairs_with_its_own_baseline_repeat():
    pairs = resting_pairs([result()], "dspark", max_drafted=1)
    assert list(pairs) == [32] and len(pairs[32]) == 2
    c = costs(pairs[32])
    assert c["runs"] == 2 and c["wall_ratio"] == pytest.approx(1.015)
    assert c["phase_us"]["schedule"] == pytest.approx(35.0) and c["phase_us"]["forward"] == pytest.approx(0.0)
    assert c["prompt_step_ms"] == pytest.approx(0.025) and c["captures"] == pytest.approx(0.5)
    strict = costs(resting_pairs([result()], "dspark", max_drafted=0)[32])
    assert strict["runs"] == 1 and strict["phase_us"]["schedule"] == pytest.approx(30.0)
    assert c["wall_geomean"] == pytest.approx((1.02 * 1.01) ** 0.5)
    # no capture step either: only the repeat that drafted once and captured nothing is left
    bare = resting_pairs([result()], "dspark", max_drafted=1, no_captures=True)[32]
    assert [run["wall_s"] for _, run in bare] == [1.01]
    assert resting_pairs([result()], "dspark", max_drafted=0, no_captures=True) == {}


def test_the_command_prints_a_row_per_concurrency_and_refuses_a_missing_row(tmp_path, capsys):
    path = tmp_path / "speedup.json"
    path.write_text(json.dumps(result()))
    assert main([str(path)]) == 0
    out = capsys.readouterr().out
    assert "| 32 | 2 | 1.0150 | 1.0150 | +35.0 | +0.0 | +0.025 | 0.50 | - |" in out     # runs before session 33
    spans = result()
    for i, resting in enumerate(spans["workloads"]["coding.eval"]["32"]["rows"]["dspark"]["runs"]):
        resting["gate_rest_span_steps"] = 10 * (i + 1)
    (tmp_path / "spans.json").write_text(json.dumps(spans))
    assert main([str(tmp_path / "spans.json")]) == 0
    assert "| +0.025 | 0.50 | 15.0 |" in capsys.readouterr().out         # the mean over the resting runs
    with pytest.raises(SystemExit):
        main([str(path), "--row", "eagle3"])
    other = result()                 # a run of another table (c = 16 only) pools with it by concurrency
    other["workloads"]["coding.eval"]["16"] = other["workloads"]["coding.eval"].pop("32")
    (tmp_path / "other.json").write_text(json.dumps(other))
    assert main([str(path), str(path), str(tmp_path / "other.json")]) == 0
    out = capsys.readouterr().out
    assert "| 16 | 2 | 1.0150 |" in out and "| 32 | 4 | 1.0150 |" in out
