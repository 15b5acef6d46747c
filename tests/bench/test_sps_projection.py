"""`python -m bench sps-projection --shape tiny` on the CPU: the timing tables are complete and positive,
the projection is labelled as one, and the projection arithmetic on hand-made timings."""
from __future__ import annotations

import json

import pytest

from bench.__main__ import main as bench_main
from bench.sps_projection import PROJECTION_LABEL, ROUND_PARTS, expected_tokens, pooled_acceptance, project


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


def _flat(tree, prefix=""):
    """{'1': {'best': {'k': 0}}} -> {'1.best.k': 0}: nested projections compared with pytest.approx."""
    out = {}
    for key, value in tree.items():
        out.update(_flat(value, f"{prefix}{key}.") if isinstance(value, dict) else {f"{prefix}{key}": value})
    return out


def _acceptance(path, alpha, reached, accepted, tau, rounds, fraction=0.3):
    path.write_text(json.dumps({"tau": tau, "rounds": rounds, "acceptance_by_position": alpha,
                                "reached_by_position": reached, "accepted_by_position": accepted,
                                "draft_cost_fraction": fraction}))
    return path


def test_runs_pool_by_their_counts_not_by_their_ratios():
    a = {"acceptance_by_position": [0.5, 1.0], "reached_by_position": [10, 5], "accepted_by_position": [5, 5],
         "tau": 2.0, "rounds": 10}
    b = {"acceptance_by_position": [0.9, 0.0], "reached_by_position": [90, 81], "accepted_by_position": [81, 0],
         "tau": 1.9, "rounds": 90}
    alpha, tau = pooled_acceptance([a, b])
    assert alpha == pytest.approx([86 / 100, 5 / 86])            # the mean of the ratios would give 0.7, 0.5
    assert tau == pytest.approx((2.0 * 10 + 1.9 * 90) / 100)
    assert pooled_acceptance([a]) == ([0.5, 1.0], 2.0)
    with pytest.raises(SystemExit, match="counts"):
        pooled_acceptance([a, {"acceptance_by_position": [0.5, 0.5], "tau": 2.0, "rounds": 3}])


def test_stored_timings_project_a_new_acceptance_without_measuring(tmp_path):
    first = tmp_path / "measured"
    assert bench_main(["sps-projection", "--shape", "tiny", "--batches", "1,2", "--context", "16", "--gamma", "2",
                       "--repeats", "1", "--out", str(first)]) == 0
    stored = json.loads((first / "sps_projection.json").read_text())
    x = _acceptance(tmp_path / "x.json", [0.8, 0.5], [10, 8], [8, 4], 2.2, 10)
    y = _acceptance(tmp_path / "y.json", [0.2, 0.5], [30, 6], [6, 3], 1.3, 30)
    out = tmp_path / "projected"
    assert bench_main(["sps-projection", "--timings", str(first / "sps_projection.json"), "--acceptance", str(x),
                       "--acceptance", str(y), "--draft-fraction", "0.4,0.0", "--out", str(out)]) == 0
    result = json.loads((out / "sps_projection.json").read_text())
    assert result["verify_ms"] == stored["verify_ms"] and result["markov"] == stored["markov"]
    assert result["timings_from"]["path"] == str(first / "sps_projection.json")
    proj = result["projection"]
    verify_s = {int(b): [t / 1e3 for t in v] for b, v in stored["verify_ms"].items()}
    markov_s = {int(b): m["loop_ms"] / 1e3 for b, m in stored["markov"].items()}
    pooled = [14 / 40, 7 / 14]
    assert proj["acceptance_by_position"] == pytest.approx(pooled) and proj["draft_cost_fraction"] == 0.4
    assert _flat(proj["by_batch"]) == pytest.approx(_flat(project(verify_s, markov_s, pooled, 0.4)))
    assert _flat(proj["by_draft_fraction"]["0.0"]) == pytest.approx(_flat(project(verify_s, markov_s, pooled, 0.0)))
    assert _flat(proj["by_source"]["x"]["by_batch"]) == pytest.approx(_flat(project(verify_s, markov_s, [0.8, 0.5],
                                                                                    0.4)))
    md = (out / "sps_projection.md").read_text()
    assert "Timings not measured by this command" in md and "Sensitivity to the draft cost fraction" in md
    assert "| x | 2.20 | 0.8 |" in md and "## PROJECTION, not a measurement" in md


def test_a_bad_timings_file_is_a_clear_error(tmp_path):
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"verify_ms": {}}))
    with pytest.raises(SystemExit, match="not a sps_projection.json"):
        bench_main(["sps-projection", "--timings", str(bad), "--out", str(tmp_path / "o")])


def test_a_measured_draft_round_replaces_the_assumed_fraction(tmp_path):
    first = tmp_path / "measured"
    assert bench_main(["sps-projection", "--shape", "tiny", "--batches", "1,2,4", "--context", "16", "--gamma", "2",
                       "--repeats", "1", "--out", str(first)]) == 0
    stored = json.loads((first / "sps_projection.json").read_text())
    parts = {"greedy": (0.5, 0.25, 0.125), "T0.7-k20-p0.9": (9.0, 9.0, 9.0)}     # ms of the three parts
    rows = {f"b{b}_{name}": {part: {"host_ms_p50": 0.1, "total_ms_p50": ms * b} for part, ms in zip(ROUND_PARTS, v)}
            for b in (1, 2, 8) for name, v in parts.items()}                     # B = 8 was not timed here
    rounds = tmp_path / "draft_round-tiny.json"
    rounds.write_text(json.dumps({"shape": "tiny", **rows}))
    x = _acceptance(tmp_path / "x.json", [0.8, 0.5], [10, 8], [8, 4], 2.2, 10)
    out = tmp_path / "projected"
    assert bench_main(["sps-projection", "--timings", str(first / "sps_projection.json"), "--acceptance", str(x),
                       "--draft-round", str(rounds), "--draft-fraction", "0.3", "--out", str(out)]) == 0
    proj = json.loads((out / "sps_projection.json").read_text())["projection"]
    verify_s = {int(b): [t / 1e3 for t in v] for b, v in stored["verify_ms"].items()}
    charged = {1: 0.875e-3, 2: 1.75e-3}                                          # greedy: the parts summed, by B
    assert proj["draft_round_ms"] == pytest.approx({"1": 0.875, "2": 1.75}) and proj["draft_cost_fraction"] is None
    want = project({b: verify_s[b] for b in charged}, charged, [0.8, 0.5], 0.0)
    assert set(proj["by_batch"]) == {"1", "2"}                                   # only batches both measured
    assert _flat(proj["by_batch"]) == pytest.approx(_flat(want))
    # the fraction the command also gave runs beside it, over every timed batch
    markov_s = {int(b): m["loop_ms"] / 1e3 for b, m in stored["markov"].items()}
    assert _flat(proj["by_draft_fraction"]["0.3"]) == pytest.approx(_flat(project(verify_s, markov_s, [0.8, 0.5], 0.3)))
    assert "measured at this shape" in (out / "sps_projection.md").read_text()
    with pytest.raises(SystemExit, match="no rows for setting"):
        bench_main(["sps-projection", "--timings", str(first / "sps_projection.json"), "--acceptance", str(x),
                    "--draft-round", str(rounds), "--draft-setting", "T1", "--out", str(out)])
