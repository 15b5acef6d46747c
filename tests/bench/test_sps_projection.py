"""`python -m bench sps-projection --shape tiny` on the CPU: the timing tables are complete and positive,
the projection is labelled as one, and the projection arithmetic on hand-made timings."""
from __future__ import annotations

import json

import pytest

from bench.__main__ import main as bench_main
from bench.sps_projection import PROJECTION_LABEL, expected_tokens, project


def test_expected_tokens_and_projection_arithmetic():
    alpha = [0.5, 0.5, None]
    assert expected_tokens(alpha, 0) == 1.0
    assert expected_tokens(alpha, 2) == pytest.approx(1 + 0.5 + 0.25)
    assert expected_tokens(alpha, 3) == pytest.approx(1.75)           # an unmeasured position never accepts
    # B=1: verify costs the same at every k, nothing else -> speed-up = E(k); B=8: verify doubles per draft
    proj = project({1: [1.0, 1.0, 1.0, 1.0], 8: [1.0, 2.0, 3.0, 4.0]}, {1: 0.0, 8: 0.0}, alpha, 0.0)
    assert proj["1"]["fixed_gamma"] == {"k": 3, "expected_tokens": 1.75, "speedup": pytest.approx(1.75)}
    assert proj["1"]["best"]["k"] == 2                                  # k=3 adds cost-free nothing: the first best
    assert proj["8"]["best"] == {"k": 0, "expected_tokens": 1.0, "speedup": 1.0}   # speculation never pays
    slowed = project({1: [1.0, 1.0]}, {1: 0.5}, [1.0], 1.0)             # drafting + Markov loop cost
    assert slowed["1"]["fixed_gamma"]["speedup"] == pytest.approx(2 * 1.0 / (1.0 * 2 + 0.5))


def test_tiny_shape_end_to_end(tmp_path):
    acc = tmp_path / "acceptance.json"
    acc.write_text(json.dumps({"tau": 2.0, "acceptance_by_position": [0.9, 0.5, None], "draft_cost_fraction": 0.1}))
    out = tmp_path / "out"
    assert bench_main(["sps-projection", "--shape", "tiny", "--batches", "1,3", "--context", "40", "--gamma", "3",
                       "--repeats", "1", "--acceptance", str(acc), "--out", str(out)]) == 0
    result = json.loads((out / "sps_projection.json").read_text())
    assert result["model_config"]["num_layers"] == 2 and result["model_config"]["arch"] == "qwen3"
    assert set(result["decode"]) == set(result["verify_ms"]) == set(result["markov"]) == {"1", "3"}
    for b, d in result["decode"].items():
        assert d["step_ms"] > 0 and d["tokens_per_s"] == pytest.approx(int(b) * 1e3 / d["step_ms"])
        assert len(result["verify_ms"][b]) == 4 and result["verify_ms"][b][0] == pytest.approx(d["step_ms"])
        assert 0 < result["markov"][b]["share_of_round"] < 1
        assert result["markov"][b]["eager_loop_ms"] > 0 and 0 < result["markov"][b]["eager_share_of_round"] < 1
    assert result["markov_graphs"] is False          # the CPU runs the static round without a graph
    proj = result["projection"]
    assert proj["label"] == PROJECTION_LABEL and "PROJECTION" in proj["label"]
    assert set(proj["by_batch"]) == {"1", "3"} and proj["draft_cost_fraction"] == 0.1
    assert all(p["best"]["speedup"] >= 1.0 and p["fixed_gamma"]["k"] == 3 for p in proj["by_batch"].values())
    md = (out / "sps_projection.md").read_text()
    assert "## PROJECTION, not a measurement" in md and "| 3 |" in md


def test_without_acceptance_there_is_no_projection(tmp_path):
    out = tmp_path / "out"
    assert bench_main(["sps-projection", "--shape", "tiny", "--batches", "2", "--context", "16", "--gamma", "1",
                       "--repeats", "1", "--out", str(out)]) == 0
    assert json.loads((out / "sps_projection.json").read_text())["projection"] is None
    assert "No projection" in (out / "sps_projection.md").read_text()
