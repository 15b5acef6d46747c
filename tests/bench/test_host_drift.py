"""bench.host_drift: timed runs whose host-only phases ran slow against their row's fastest repeat."""
from __future__ import annotations

import pytest

from bench.host_drift import host_drift_line, slowdowns


def run(output, commit=0.05):
    return {"phase_ms_per_step": {"schedule": 0.3, "forward": 2.0, "output": output, "commit": commit}}


def test_each_run_is_read_against_its_own_rows_fastest_repeat_in_the_cell():
    workloads = {"coding": {"16": {"rows": {
        "none": {"runs": [run(0.15), run(0.20), run(0.25)]},        # 1.0, 1.25, 1.5 of 0.2 ms
        "dspark": {"runs": [run(0.35), run(0.35)]},                 # its own fastest: 1.0, 1.0
        "eagle3": {"runs": [run(0.15)]}}}}}                         # one repeat: not counted
    assert sorted(slowdowns(workloads)) == pytest.approx([1.0, 1.0, 1.0, 1.25, 1.5])
    line = host_drift_line(workloads)
    assert "timed runs of 5: ≥ 1.2×: 2, ≥ 1.4×: 1." in line


def test_a_table_without_phase_times_says_so():
    assert "no row with two repeats" in host_drift_line({"w": {"1": {"rows": {"none": {"runs": [{}, {}]}}}}})
