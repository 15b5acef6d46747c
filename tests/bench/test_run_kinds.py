"""bench.run_kinds: a row's runs split by what its drafter did in them, against `none`'s run of the same repeat."""
from __future__ import annotations

import math

import pytest

from bench.run_kinds import cohort, kind, main, ratios_by_kind, run_lines, same_path, table, where


def run(tok_s: float, **steps: int) -> dict:
    return {"throughput_tok_s": tok_s, "step_kinds": {k: {"steps": n, "ms": 1.0, "tokens": n} for k, n in steps.items()}}


def result() -> dict:
    none = [run(100.0, plain=10) for _ in range(4)]
    row = [run(99.0, plain=10), run(98.0, plain=9, capture=1), run(90.0, plain=8, draft=2),
           run(99.0, plain=10, prompt_draft=1)]
    return {"workloads": {"w": {"32": {"rows": {"none": {"runs": none}, "dspark": {"runs": row}}}}}}


def test_a_run_is_drafted_captured_or_rested_by_its_step_kinds():
    assert [kind(r) for r in result()["workloads"]["w"]["32"]["rows"]["dspark"]["runs"]] == [
        "rested", "captured", "drafted", "drafted"]
    assert kind({"throughput_tok_s": 1.0}) == "rested"        # no step kinds recorded: nothing drafted


def test_each_kind_gets_its_ratios_and_its_share_of_the_loss():
    by = ratios_by_kind([result()], "dspark")
    assert by == {32: {"rested": [0.99], "captured": [0.98], "drafted": [0.9, 0.99]}}
    text = table([result()], "dspark", resamples=200)
    total = math.log(0.99) + math.log(0.98) + math.log(0.9) + math.log(0.99)
    drafted = 0.5 * (math.log(0.9) + math.log(0.99)) / 2 / (total / 4)      # share × log geomean / mean log
    assert f"| 32 | drafted | 2 | 50% | {math.sqrt(0.9 * 0.99):.3f}" in text
    assert f"{drafted:.0%} |" in text.splitlines()[-1]
    assert drafted == pytest.approx(0.792, abs=1e-3)       # 79% of the loss in half the runs


def test_runs_lists_each_run_in_repeat_order_with_its_kind_ratio_and_drafting_steps():
    text = run_lines([result(), result()], "dspark")
    lines = text.splitlines()
    assert lines[2] == "| 1 | w | 32 | r0.99/0 c0.98/0 d0.90/2 d0.99/1 |"      # prompt_draft steps count as drafting
    assert lines[3].startswith("| 2 | w | 32 | r0.99/0 ")                      # each result on its own line
    assert len(lines) == 4


def result_file(tmp_path) -> str:
    """``result()`` written where the command line reads it."""
    import json

    path = tmp_path / "speedup.json"
    path.write_text(json.dumps(result()))
    return str(path)


def test_the_runs_flag_prints_the_listing_instead_of_the_table(tmp_path, capsys):
    path = result_file(tmp_path)
    assert main([path, "--runs"]) == 0
    assert "d0.90/2" in capsys.readouterr().out
    assert main([path]) == 0
    out = capsys.readouterr().out
    assert "| 32 | drafted | 2 |" in out and "d0.90/2" not in out


def timed(tok_s: float, wall_s: float, **kinds: tuple[int, float]) -> dict:
    return {"throughput_tok_s": tok_s, "wall_s": wall_s,
            "step_kinds": {k: {"steps": n, "ms": ms, "tokens": n} for k, (n, ms) in kinds.items()}}


def test_where_splits_each_kinds_extra_time_into_prompt_and_decode_steps():
    none = [timed(100.0, 0.100, prompt=(4, 40.0), plain=(20, 60.0)) for _ in range(3)]
    row = [timed(100.0, 0.101, prompt=(4, 40.5), plain=(20, 60.5)),                       # rested
           timed(90.0, 0.110, prompt=(6, 52.0), prompt_draft=(1, 8.0), draft=(5, 30.0), plain=(6, 20.0)),
           timed(88.0, 0.112, prompt=(5, 47.0), draft=(4, 25.0), capture=(1, 3.0), plain=(10, 31.0))]
    res = {"workloads": {"w": {"32": {"rows": {"none": {"runs": none}, "dspark": {"runs": row}}}}}}
    lines = where([res], "dspark").splitlines()
    assert lines[2] == "| 32 | rested | 1 | +0.0 | +0.5 | +0.5 | +1.0 (100) | - |"     # no finishes recorded
    # drafted: prompt steps +3 and +1 (prompt_draft counts as a prompt step), +20.0 and +7.0 ms in them;
    # decode steps 50 and 59 ms against 60: -10.0 and -1.0; wall +10 and +12 ms
    assert lines[3] == "| 32 | drafted | 2 | +2.0 | +13.5 | -5.5 | +11.0 (100) | - |"
    assert len(lines) == 4
    for r in none:               # 8 requests: `none` in two cohorts of 4, the row's spread over 8 steps and 4
        r["finish_cohorts"] = {"4": 2}
    row[1]["finish_cohorts"], row[2]["finish_cohorts"] = {"1": 8}, {"2": 4}
    assert where([res], "dspark").splitlines()[3].endswith("| 1.50 (4.00) |")


def test_the_where_and_runs_views_are_one_at_a_time(tmp_path, capsys):
    path = result_file(tmp_path)
    assert main([path, "--where"]) == 0
    assert "+ms in prompt steps" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        main([path, "--where", "--runs"])


def test_a_runs_cohort_is_the_mean_requests_a_finishing_step_finished():
    assert cohort({"finish_cohorts": {"1": 6, "3": 2}}) == 12 / 8


def test_same_path_keeps_only_runs_that_did_none_s_work_and_sets_the_a_a_row_beside_them():
    def run_(tok_s, tokens, steps, **kinds):
        return {**run(tok_s, **kinds), "tokens": tokens, "steps": steps}

    none = [run_(100.0, 500, 50, plain=50) for _ in range(4)]
    aa = [run_(x, 500, 50, plain=50) for x in (101.0, 99.0, 100.0, 98.0)]
    row = [run_(98.0, 500, 50, plain=50),                  # rested, same work: kept
           run_(97.0, 500, 50, plain=49, capture=1),       # captured only, same work: kept
           run_(90.0, 520, 55, plain=54, draft=1),         # drafted: its sampled answers changed, left out
           run_(95.0, 510, 52, plain=52)]                  # rested but other tokens (a preemption, say): left out
    res = {"workloads": {"w": {"32": {"rows": {"none": {"runs": none}, "none-aa": {"runs": aa},
                                               "dspark": {"runs": row}}}}}}
    lines = same_path([res], "dspark", resamples=200).splitlines()
    assert lines[2].startswith(f"| 32 | 2 of 4 | {math.sqrt(0.98 * 0.97):.3f} (")
    assert f"| {math.sqrt(1.01 * 0.99):.3f} (" in lines[2]          # the A/A row in the same two repeats
    del res["workloads"]["w"]["32"]["rows"]["none-aa"]
    assert same_path([res], "dspark", resamples=200).splitlines()[2].endswith("| - |")
