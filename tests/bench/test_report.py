"""Report writer: files appear, derived numbers are right, and check_report catches planted inconsistencies."""
from __future__ import annotations

import copy
import json
import random

import pytest

from bench.cost import cost_per_million_output_tokens
from bench.report import ReportError, check_report, summarize_results, write_report
from bench.report import main as report_main
from bench.stats import StatsError, percentile, summarize

ACCEPTANCE = [0.8, 0.6, 0.45, 0.3, 0.2, 0.1, 0.05]


def _cell(rng: random.Random, concurrency: int, speculation: bool) -> dict:
    n = 4 * concurrency
    cell = {"gpus": 1, "wall_time_s": 2.0 + concurrency / 8, "requests": n, "prompt_tokens": 500 * n,
            "cached_prompt_tokens": 200 * n, "completion_tokens": 30 * n,
            "ttft_s": [rng.uniform(0.05, 0.5) for _ in range(n)],
            "itl_s": [rng.uniform(0.01, 0.04) for _ in range(29 * n)]}
    if speculation:
        cell["speculation"] = {"verifications": 100, "drafted": 700, "accepted": round(sum(ACCEPTANCE) * 100),
                               "acceptance_by_position": ACCEPTANCE}
        cell["quality"] = {"field_accuracy": 0.75}
    return cell


@pytest.fixture
def results() -> dict:
    rng = random.Random(0)
    return {"meta": {"workload": "support", "command": "python -m bench serve --workload support"},
            "configs": {name: {c: _cell(rng, c, name == "ours") for c in (1, 8)}
                        for name in ("standard", "prefix-lru", "ours")}}


def test_consistent_results_pass(results):
    assert check_report(results) == []


def test_writer_produces_every_file(results, tmp_path):
    paths = write_report(results, tmp_path)
    for name in ("results", "report", "latency_vs_throughput", "ttft", "acceptance_by_position"):
        assert paths[name].exists() and paths[name].stat().st_size > 0, name
    assert paths["ttft"].read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    written = json.loads(paths["results"].read_text())
    assert check_report(written) == []  # the written file passes the same checks as its input
    assert set(written["summary"]) == {"standard", "prefix-lru", "ours"}
    md = paths["report"].read_text()
    assert "| ours | 8 |" in md and "TTFT p99 ms" in md and "Acceptance by position" in md and "field_accuracy" in md
    assert "![ttft](ttft.png)" in md


def test_no_acceptance_plot_without_speculation(results, tmp_path):
    del results["configs"]["ours"]
    paths = write_report(results, tmp_path)
    assert "acceptance_by_position" not in paths and not (tmp_path / "acceptance_by_position.png").exists()
    assert "| - |" in paths["report"].read_text()  # τ shown as absent, not as a number


def test_derived_metrics(results):
    cell = results["configs"]["ours"][8]
    row = summarize_results(results)["ours"]["8"]
    assert row["output_tok_s_per_gpu"] == pytest.approx(cell["completion_tokens"] / cell["wall_time_s"])
    assert row["requests_per_s"] == pytest.approx(cell["requests"] / cell["wall_time_s"])
    assert row["cache_share"] == pytest.approx(0.4)
    assert row["tau"] == pytest.approx(cell["speculation"]["accepted"] / 100 + 1)
    assert row["ttft_s"]["p50"] == pytest.approx(percentile(cell["ttft_s"], 50))
    expected_cost = 3.99 * cell["wall_time_s"] / 3600 / cell["completion_tokens"] * 1e6
    assert row["cost_per_1m_output_usd"] == pytest.approx(expected_cost)
    assert row["speedup_vs_baseline"] == pytest.approx(1.0)  # same token counts and wall times as standard
    results["configs"]["ours"][8]["wall_time_s"] /= 2
    assert summarize_results(results)["ours"]["8"]["speedup_vs_baseline"] == pytest.approx(2.0)


def _plant(results: dict, edit) -> list[str]:
    planted = copy.deepcopy(results)
    edit(planted["configs"])
    return check_report(planted)


@pytest.mark.parametrize("edit, expected", [
    (lambda c: c["ours"][1].update(cached_prompt_tokens=c["ours"][1]["prompt_tokens"] + 1), "cached_prompt_tokens"),
    (lambda c: c["prefix-lru"].pop(8), "missing concurrency levels ['8']"),
    (lambda c: c["standard"][1].update(completion_tokens=0), "completion_tokens must be a positive"),
    (lambda c: c["standard"][1].update(gpus=0), "gpus must be a positive"),
    (lambda c: c["standard"][1].update(wall_time_s=-1.0), "wall_time_s must be positive"),
    (lambda c: c["standard"][8]["ttft_s"].pop(), "TTFT samples"),
    (lambda c: c["standard"][8]["ttft_s"].__setitem__(0, float("nan")), "non-finite"),
    (lambda c: c["standard"][1]["itl_s"].extend([0.01] * 10), "ITL samples"),
    (lambda c: c["standard"][1].pop("itl_s"), "missing fields"),
    (lambda c: c["ours"][1]["speculation"].update(accepted=800), "accepted"),
    (lambda c: c["ours"][1]["speculation"].update(acceptance_by_position=[0.5, 0.7]), "rises with position"),
    (lambda c: c["ours"][8]["speculation"].update(accepted=100), "implies"),
    (lambda c: c["ours"][8]["speculation"].update(verifications=0), "verifications"),
    (lambda c: c.update(bad={0: c["ours"][1], 8: c["ours"][8]}), "concurrency must be a positive integer"),
])
def test_check_report_catches_planted_inconsistency(results, edit, expected):
    problems = _plant(results, edit)
    assert any(expected in p for p in problems), problems


def test_check_report_catches_disordered_percentiles_in_a_written_file(results, tmp_path):
    written = json.loads(write_report(results, tmp_path)["results"].read_text())
    written["summary"]["ours"]["1"]["ttft_s"]["p99"] = written["summary"]["ours"]["1"]["ttft_s"]["p50"] / 2
    assert any("percentiles out of order" in p for p in check_report(written))


def test_writer_refuses_inconsistent_results_unless_told(results, tmp_path):
    results["configs"]["ours"][1]["cached_prompt_tokens"] = 10**9
    with pytest.raises(ReportError) as err:
        write_report(results, tmp_path / "strict")
    assert err.value.problems
    paths = write_report(results, tmp_path / "lenient", allow_problems=True)
    assert "Consistency problems" in paths["report"].read_text()


def test_empty_results_are_a_problem():
    assert check_report({"configs": {}}) == ["no configs"]


def test_stats_and_cost():
    assert percentile([1, 2, 3, 4], 50) == 2.5
    assert percentile([5.0], 99) == 5.0
    s = summarize([0.1, 0.2, 0.3, 0.4, 10.0])
    assert s["count"] == 5 and s["p50"] == 0.3 and s["p50"] <= s["p95"] <= s["p99"] <= 10.0
    assert summarize([])["p99"] is None
    with pytest.raises(StatsError):
        percentile([], 50)
    # 1000 tok/s on one GPU for an hour: 3.6M tokens for $3.99
    assert cost_per_million_output_tokens(3_600_000, 3600.0, 1) == pytest.approx(3.99 / 3.6)
    assert cost_per_million_output_tokens(3_600_000, 3600.0, 8) == pytest.approx(8 * 3.99 / 3.6)
    with pytest.raises(ValueError):
        cost_per_million_output_tokens(0, 1.0, 1)


def test_rerender_from_results_json(results, tmp_path, capsys):
    first = write_report(results, tmp_path / "a")
    assert report_main([str(first["results"]), "--out", str(tmp_path / "b")]) == 0
    assert "| standard | 1 |" in capsys.readouterr().out
    again = json.loads((tmp_path / "b/results.json").read_text())
    assert again["summary"] == json.loads(first["results"].read_text())["summary"]


def test_tau_counts_the_target_token_and_is_none_without_verifications():
    from bench.stats import tau
    assert tau(10, 25) == 3.5          # 25 accepted drafts + one target token per verification, over 10
    assert tau(4, 0) == 1.0            # every draft rejected: the target's own token each time
    assert tau(0, 0) is None           # never drafted: no τ, not 1


def test_geomean_interval_is_the_geometric_mean_with_a_seeded_bootstrap_interval():
    import math

    from bench.stats import geomean_interval

    mean, lo, hi = geomean_interval([0.5, 2.0, 1.0, 1.0])
    assert mean == pytest.approx(1.0) and 0.5 < lo < 1.0 < hi < 2.0      # 0.5 and 2 cancel
    assert geomean_interval([0.5, 2.0, 1.0, 1.0]) == (mean, lo, hi)          # seeded: reproducible
    assert geomean_interval([0.9] * 5) == pytest.approx((0.9, 0.9, 0.9))
    assert geomean_interval([1.0, 4.0], resamples=2000)[1:] == pytest.approx((1.0, 4.0))   # draws aa, ab, bb
    assert math.isclose(geomean_interval([2.0, 8.0])[0], 4.0)
    for bad in ([], [1.0, 0.0], [1.0, float("nan")]):
        with pytest.raises(StatsError):
            geomean_interval(bad)


def test_median_interval_is_the_median_on_logs_and_barely_moves_for_one_slow_repeat():
    import math

    from bench.stats import geomean_interval, median_interval

    assert median_interval([1.0, 4.0])[0] == pytest.approx(2.0)        # an even pair meets at its geometric mean
    steady = [0.99, 1.0, 1.01] * 6
    slow = steady[:-1] + [0.6]                                            # one repeat caught by the host's drift
    assert median_interval(slow)[0] == pytest.approx(1.0)
    assert geomean_interval(slow)[0] < 0.98                               # where the mean moves by ~2.5%
    g, lo, hi = median_interval(slow)
    assert lo <= g <= hi and hi - lo < geomean_interval(slow)[2] - geomean_interval(slow)[1]
    assert median_interval(slow) == (g, lo, hi)                           # seeded
    assert median_interval([0.9] * 5) == pytest.approx((0.9, 0.9, 0.9))
    assert math.isclose(median_interval([0.5, 1.0, 8.0])[0], 1.0)
    for bad in ([], [1.0, 0.0], [1.0, float("nan")]):
        with pytest.raises(StatsError):
            median_interval(bad)


def test_bootstrap_bounds_are_the_draws_at_2_5_and_97_5_percent():
    from bench.stats import bootstrap_bounds

    draws = [float(i) for i in range(200, 0, -1)]          # unsorted: 1..200
    assert bootstrap_bounds(draws) == (6.0, 195.0)           # the 6th and the 195th of 200, no interpolation
    assert bootstrap_bounds([3.0]) == (3.0, 3.0)
    with pytest.raises(StatsError):
        bootstrap_bounds([])
