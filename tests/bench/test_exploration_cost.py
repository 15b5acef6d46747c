"""bench.exploration_cost: the drafting and capture steps of a resting cell, priced in its own plain steps."""
from __future__ import annotations

import gzip
import json

import pytest

from bench.exploration_cost import by_level, main, run_cost, table
from tests.bench.test_step_split import NONE, run


def probed(wall_ms=540.0, reasons=None):
    """A resting repeat: 176 plain steps (2.3 ms, 16 tokens each), one 3-step probe (two drafting steps of
    9.2 ms emitting 24 tokens each, the first step a capture of 2.5 ms)."""
    r = run(wall_ms, (16, 112.0, 232), (176, 404.8, 2816), draft=(2, 18.4, 48))
    r["step_kinds"]["capture"] = {"steps": 1, "ms": 2.5, "tokens": 16}
    r["gate_drafted_by"] = reasons or {"probe": 3, "explore": 0, "class": 0, "winner": 0}
    return r


def test_a_repeat_is_priced_in_its_own_plain_steps():
    c = run_cost(probed())
    plain_ms = 404.8 / 176                                   # 2.3 ms, 16 tokens a plain step
    assert c["draft_excess_ms"] == pytest.approx(18.4 - 2 * plain_ms)       # 13.8 ms over two plain steps
    assert c["capture_excess_ms"] == pytest.approx(2.5 - plain_ms)
    assert c["gain_ms"] == pytest.approx((48 - 2 * 16) * 404.8 / 2816)      # 16 tokens more: one plain step
    assert (c["draft_steps"], c["capture_steps"], c["probe"], c["wall_ms"]) == (2, 1, 3, 540.0)
    assert run_cost(run(100.0, (4, 28.0, 58), (0, 0.0, 0))) is None          # no plain step to price by


def test_levels_keep_resting_cells_only_and_print_percent_of_wall(tmp_path, capsys):
    winner = probed(reasons={"probe": 0, "explore": 0, "class": 0, "winner": 40})
    result = {"workloads": {
        "coding.eval": {"16": {"rows": {"none": {"runs": [NONE, NONE]}, "dspark": {"runs": [probed(), NONE]}}}},
        "extraction.eval": {"16": {"rows": {"none": {"runs": [NONE]}, "dspark": {"runs": [winner]}}}}}}
    levels = by_level([result], "dspark")
    a = levels[16]
    assert (a["cells"], a["repeats"], a["draft_steps"], a["probe"]) == (1, 2, 2, 3)    # extraction drafted as winner
    assert a["wall_ms"] == pytest.approx(540.0 + 529.7)
    path = tmp_path / "speedup.json.gz"
    with gzip.open(path, "wt") as f:
        json.dump(result, f)
    assert main([str(path)]) == 0
    out = capsys.readouterr().out
    excess, gain, capture = 18.4 - 4.6, 2.3, 0.2            # ms; of 1,069.7 ms of wall
    net = 100 * (excess + capture - gain) / 1069.7
    assert (f"| 16 | 1 | 2 | 1.00 | 1.50 / 0.00 / 0.00 / 0.00 | 0.50 | {100 * excess / 1069.7:.2f}% | "
            f"{100 * gain / 1069.7:.2f}% | {100 * capture / 1069.7:.2f}% | {net:.2f}% |") in out
    assert table({}, "dspark").startswith("No resting cell")


def test_runs_of_different_tables_pool_over_the_loads_they_share():
    """CQ ran every load, CR only c = 16 and 32: each run is read on its own, and a level sums both."""
    one = {"workloads": {"coding.eval": {"16": {"rows": {"none": {"runs": [NONE]}, "dspark": {"runs": [probed()]}}},
                                         "4": {"rows": {"none": {"runs": [NONE]}, "dspark": {"runs": [probed()]}}}}}}
    two = {"workloads": {"support.eval": {"16": {"rows": {"none": {"runs": [NONE]}, "dspark": {"runs": [probed()]}}}}}}
    levels = by_level([one, two], "dspark")
    assert sorted(levels) == [4, 16]
    assert (levels[16]["cells"], levels[16]["repeats"], levels[4]["cells"]) == (2, 2, 1)
    assert levels[16]["draft_excess_ms"] == pytest.approx(2 * run_cost(probed())["draft_excess_ms"])
