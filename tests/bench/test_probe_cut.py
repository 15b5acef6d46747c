"""bench.probe_cut: which recorded probes the probe cut would have ended, judged as ``SpecGate._cuts`` judges."""
from __future__ import annotations

import gzip
import json

import pytest

from bench.probe_cut import main, probes, report, run_probes, verdict


def rep(drafted, tokens, ms, seqs, used, why, acc=None, pred=None, plain=None):
    return [drafted, tokens, ms, seqs, used, why, acc, pred, plain]


CLEAR = [rep(0, 32, 3.0, 32, 1, "winner", 1.5, 4000.0, 10000.0),
         rep(1, 40, 12.0, 32, 1, "probe", 1.5, 4000.0, 10000.0),
         rep(1, 40, 11.0, 32, 1, "probe", 1.2, 3000.0, 10000.0),      # predicted 0.3 of plain: cut here
         rep(1, 41, 10.0, 32, 1, "probe", 1.2, 3100.0, 10000.0),
         rep(0, 32, 3.1, 32, 1, "winner", 1.2, 3100.0, 10000.0)]
NEAR = [rep(1, 8, 4.0, 4, 0, "probe", None, 0.0, 2000.0),           # a warm-up: the probe starts after it
        rep(1, 10, 4.0, 4, 1, "probe", 2.0, 1300.0, 2000.0),
        rep(1, 10, 4.0, 4, 1, "probe", 2.0, 1100.0, 2000.0),         # 0.55 of plain: twice that wins
        rep(0, 4, 2.0, 4, 1, "winner", 2.0, 1100.0, 2000.0)]


def result(cells: int = 2) -> dict:
    cell = {"rows": {"none": {"runs": []}}, "gate_recent": {"dspark_b32": CLEAR, "dspark_b4": NEAR},
            "gate": {"spec_gate_probes_total": 7}}
    return {"workloads": {"w": {str(c): json.loads(json.dumps(cell)) for c in range(cells)}}}


def test_a_probe_is_judged_at_the_step_after_its_first_sample():
    clear, = probes(CLEAR)
    v = verdict(clear, 2.0)
    assert v["judged"] and v["cut"] and v["ratio"] == pytest.approx(0.3)
    # the skipped steps over plain steps of their batch: 32 tokens at 10,000 tok/s is 3.2 ms
    assert v["saved_ms"] == pytest.approx((11.0 - 3.2) + (10.0 - 3.2))
    near, = probes(NEAR)
    assert len(near) == 2                         # the warm-up is no sample
    assert not verdict(near, 2.0)["cut"] and verdict(near, 1.5)["cut"]      # 0.55 × 1.5 < 1.03
    assert not verdict(near[:1], 1.0)["judged"]   # one step: nothing to judge


def test_a_report_repeated_in_cells_counts_once_and_sums_by_bucket(tmp_path):
    found, started = run_probes(result(cells=3))
    assert len(found) == 2 and started == 7
    text = report([("r", result())], 2.0)
    assert "| b4 | 1 | 1 | 0 | 2 | 2 | 0.0 |" in text
    assert "| b32 | 1 | 1 | 1 | 3 | 1 | 14.6 |" in text
    path = tmp_path / "speedup.json.gz"
    with gzip.open(path, "wt") as f:
        json.dump(result(), f)
    assert main([str(path), "--list"]) == 0
    with pytest.raises(SystemExit):
        main([str(path), "--cut", "0.5"])
