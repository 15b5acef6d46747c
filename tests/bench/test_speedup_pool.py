"""bench.speedup_pool: every run's per-repeat ratios pooled per cell, with a bootstrap interval."""
from __future__ import annotations

import gzip
import math
import json

import pytest

from bench.speedup_pool import PoolError, main, pooled_cell, repeats_needed, table


def result(dspark: list[float], aa: list[float], levels=("1", "4")) -> dict:
    def row(ratios):
        return {"throughput_ratio": {"per_repeat": ratios}, "per_user_ratio": {"per_repeat": ratios}}

    return {"workloads": {"coding.eval": {lvl: {"rows": {"none": row([1.0] * len(aa)), "none-aa": row(aa),
                                                         "dspark": row(dspark)}} for lvl in levels}}}


def test_a_cell_is_slower_only_when_its_whole_interval_lies_below_one():
    runs = [result([0.97, 0.98, 0.96], [1.01, 0.99, 1.0]), result([0.97, 0.97, 0.98], [0.99, 1.02, 1.0])]
    text, counts = table(runs, "dspark", resamples=2000)
    assert counts == {"cells": 2, "slower": 2, "faster": 0}
    rows = {line.split(" | ")[0]: line for line in text.splitlines()}
    assert rows["| coding.eval"].startswith("| coding.eval | **0.972 (") and rows["| coding.eval"].count("↓") == 2
    assert rows["| all workloads (geometric mean)"].count("↓") == 2     # the summary row, by concurrency
    text, counts = table(runs, "none-aa", resamples=2000)
    assert counts == {"cells": 2, "slower": 0, "faster": 0} and "↓" not in text
    # one run alone holds 3 repeats; pooled, the cell's interval is narrower than either run's
    one, _ = table(runs[:1], "dspark", resamples=2000)
    assert "(0.960-0.980)" in one


def test_the_command_pools_files_and_refuses_runs_of_other_shapes(tmp_path, capsys):
    paths = []
    for i, r in enumerate([result([1.2, 1.3], [1.0, 1.0]), result([1.25, 1.1], [1.0, 1.0])]):
        run = tmp_path / f"run{i}"
        run.mkdir()
        (run / "COMMIT").write_text("0123456789abcdef\n")
        paths.append(run / "speedup.json.gz")
        with gzip.open(paths[-1], "wt") as f:
            json.dump(r, f)
    assert main([*map(str, paths), "--resamples", "500"]) == 0
    out = capsys.readouterr().out
    assert "(commit 0123456)" in out and "dspark: 0 of 2 cells slower than `none`, 2 faster." in out
    other = tmp_path / "other.json"
    other.write_text(json.dumps(result([1.0], [1.0], levels=("1",))))
    with pytest.raises(SystemExit):
        main([str(paths[0]), str(other)])
    with pytest.raises(SystemExit):
        main([str(paths[0]), "--rows", "eagle3"])
    with pytest.raises(PoolError):
        table([json.loads(json.dumps(result([1.0], [1.0])))], "missing")


def test_the_summary_row_weighs_every_workload_alike_and_resamples_within_cells():
    import math

    from bench.speedup_pool import across_workloads

    run = result([0.9, 0.9, 0.9], [1.0] * 3)
    run["workloads"]["support.eval"] = result([1.2] * 6, [1.0] * 6)["workloads"]["coding.eval"]   # twice the repeats
    got = across_workloads([run], "dspark", "throughput_ratio")
    want = math.sqrt(0.9 * 1.2)                  # not weighted by repeats: (0.9^3 1.2^6)^(1/9) would be 1.10
    assert set(got) == {"1", "4"}
    for mean, lo, hi in got.values():
        assert mean == pytest.approx(want) and lo == pytest.approx(want) and hi == pytest.approx(want)
    text, _ = table([run], "dspark", resamples=500)
    assert f"| all workloads (geometric mean) | {want:.3f} ({want:.3f}-{want:.3f})" in text


def test_a_cell_cut_by_the_budget_reads_not_run_and_the_summary_says_how_many_workloads_it_holds():
    # `bench speedup --budget-s` leaves the cells it did not start out of the result (session 29, run CL:
    # support c = 32); the table marks them instead of failing, and the level's mean names its workloads
    run = result([0.9, 0.9], [1.0, 1.0])
    run["workloads"]["support.eval"] = {"1": result([1.2, 1.2], [1.0, 1.0])["workloads"]["coding.eval"]["1"]}
    text, counts = table([run], "dspark", resamples=500)
    rows = {line.split(" | ")[0]: line for line in text.splitlines()}
    assert rows["| support.eval"].endswith("| not run |")
    assert counts["cells"] == 3
    summary = rows["| all workloads (geometric mean)"]
    want = math.sqrt(0.9 * 1.2)
    assert f"{want:.3f}" in summary.split(" | ")[1] and "workloads)" not in summary.split(" | ")[1]
    assert "0.900" in summary.split(" | ")[2] and "(1 of 2 workloads)" in summary.split(" | ")[2]


def test_shared_pools_the_cells_every_run_has(tmp_path, capsys):
    """--shared: a full table and a run of some of its cells pool over the cells both have; the run with
    more cells alone would say otherwise at the cell the other lacks. Runs sharing no cell are refused."""
    full = tmp_path / "full.json"
    full.write_text(json.dumps(result([0.95, 0.96, 0.94], [1.0, 1.0, 1.0], levels=("1", "4"))))
    part = tmp_path / "part.json"
    part.write_text(json.dumps(result([1.05, 1.06, 1.04], [1.0, 1.0, 1.0], levels=("4",))))
    with pytest.raises(SystemExit):
        main([str(full), str(part)])                        # other tables: refused without --shared
    assert main([str(full), str(part), "--shared", "--rows", "dspark", "--resamples", "500"]) == 0
    out = capsys.readouterr().out
    header = next(line for line in out.splitlines() if line.startswith("| dspark |"))
    assert header == "| dspark | c = 4 |"                  # c = 1 is only in one run: left out
    assert "dspark: 0 of 1 cells slower" in out            # 0.95 and 1.05 pooled: neither slower nor faster
    alone = tmp_path / "alone.json"
    alone.write_text(json.dumps(result([1.0], [1.0], levels=("8",))))
    with pytest.raises(SystemExit):
        main([str(full), str(alone), "--shared"])


def test_shared_pools_by_default_the_rows_every_run_has(tmp_path, capsys):
    """--shared without --rows: runs with different diagnostic rows pool the rows they share and leave the
    others out; without --shared the first row a run lacks is refused, as before."""
    one, two = result([0.95, 0.96], [1.0, 1.0]), result([1.05, 1.06], [1.0, 1.0])
    for cell in one["workloads"]["coding.eval"].values():
        cell["rows"]["uncut"] = cell["rows"]["dspark"]
    for cell in two["workloads"]["coding.eval"].values():
        cell["rows"]["quarter"] = cell["rows"]["dspark"]
    paths = []
    for name, r in (("one.json", one), ("two.json", two)):
        (tmp_path / name).write_text(json.dumps(r))
        paths.append(str(tmp_path / name))
    with pytest.raises(SystemExit):
        main(paths + ["--resamples", "200"])                # run 2 has no row 'uncut'
    capsys.readouterr()
    assert main(paths + ["--shared", "--resamples", "200"]) == 0
    out = capsys.readouterr().out
    tables = [line.split(" | ")[0] for line in out.splitlines() if line.startswith("| ") and " c = " in line]
    assert tables == ["| none-aa", "| dspark"]


def test_runs_of_two_cards_pool_only_when_asked_and_each_file_names_its_card(tmp_path, capsys):
    paths = []
    for name, device in (("h200", "NVIDIA H200"), ("h100", "NVIDIA H100 80GB HBM3"), ("old", None)):
        r = result([1.1, 1.2], [1.0, 1.0])
        if device:
            r["device"] = device
        paths.append(tmp_path / f"{name}.json")
        paths[-1].write_text(json.dumps(r))
    with pytest.raises(SystemExit):
        main([str(paths[0]), str(paths[1])])
    assert "different cards" in capsys.readouterr().err
    assert main([str(paths[0]), str(paths[2]), "--resamples", "200"]) == 0    # a run older than the field pools
    out = capsys.readouterr().out
    assert f"{paths[0]} on NVIDIA H200" in out and f"{paths[2]}\n" in out
    assert main([str(paths[0]), str(paths[1]), "--mixed-devices", "--resamples", "200"]) == 0
    assert "on NVIDIA H100 80GB HBM3" in capsys.readouterr().out
    marked = tmp_path / "marked"        # an older run's card, written beside it
    marked.mkdir()
    (marked / "speedup.json").write_text(json.dumps(result([1.1, 1.2], [1.0, 1.0])))
    (marked / "DEVICE").write_text("NVIDIA H100\n")
    with pytest.raises(SystemExit):
        main([str(paths[0]), str(marked / "speedup.json")])
    assert main([str(paths[1]), str(marked / "speedup.json"), "--resamples", "200"]) == 0   # the same card
    capsys.readouterr()
    from bench.speedup_pool import same_card
    assert same_card("NVIDIA H100", "NVIDIA H100 80GB HBM3") and not same_card("NVIDIA H100 PCIe", "NVIDIA H100 80GB HBM3")


def test_both_baselines_divides_by_the_geometric_mean_of_the_repeats_two_plain_runs(tmp_path, capsys):
    # repeat 1: dspark 0.90 of a lucky `none`, none-aa 0.81 of it -> 0.90 / 0.9 = 1.0 of the two runs' mean
    runs = [result([0.90, 1.0], [0.81, 1.0], levels=("16",))]
    assert pooled_cell(runs, "coding.eval", "16", "dspark", "throughput_ratio", both=True) == pytest.approx([1.0, 1.0])
    assert pooled_cell(runs, "coding.eval", "16", "dspark", "throughput_ratio") == [0.90, 1.0]
    with pytest.raises(PoolError):           # the A/A row has no second baseline of its own
        pooled_cell(runs, "coding.eval", "16", "none-aa", "throughput_ratio", both=True)
    lone = result([0.9], [1.0], levels=("16",))
    del lone["workloads"]["coding.eval"]["16"]["rows"]["none-aa"]
    with pytest.raises(PoolError):
        pooled_cell([lone], "coding.eval", "16", "dspark", "throughput_ratio", both=True)
    path = tmp_path / "r.json"
    # `none` ran fast in every repeat: dspark 0.95-0.96 of it, none-aa that squared, so dspark is the two
    # plain runs' geometric mean exactly
    path.write_text(json.dumps(result([0.95, 0.96, 0.94], [0.95 ** 2, 0.96 ** 2, 0.94 ** 2], levels=("16",))))
    assert main([str(path), "--both-baselines", "--resamples", "300"]) == 0
    out = capsys.readouterr().out
    assert "dspark: 1 of 1 cells slower than `none`" in out          # against `none` alone: below 1
    assert "dspark: 0 of 1 cells slower than both baseline runs" in out   # against both: 1.000
    assert out.count("| none-aa / (none, none-aa)") == 0


def test_repeats_needed_follow_the_spread_of_the_pooled_repeats_and_the_width_asked():
    # one workload, log ratios ±0.03 around 0: sample variance 0.03² · 4/3 over 4 repeats
    ratios = [math.exp(x) for x in (0.03, -0.03, 0.03, -0.03)]
    runs = [result(ratios, [1.0, 1.0, 1.0, 1.0], levels=("32",))]
    var = 0.03 ** 2 * 4 / 3
    need, have = repeats_needed(runs, "dspark", "throughput_ratio", 0.005)["32"]
    assert have == 4 and need == math.ceil((1.96 / math.log1p(0.005)) ** 2 * var)     # 197
    # half the width asks four times the repeats; a row that never varies needs the floor of 2
    assert repeats_needed(runs, "dspark", "throughput_ratio", 0.0025)["32"][0] == pytest.approx(4 * need, rel=0.01)
    assert repeats_needed(runs, "none-aa", "throughput_ratio", 0.005)["32"] == (2, 4)


def test_the_resolution_flag_prints_the_repeats_each_row_needs(tmp_path, capsys):
    path = tmp_path / "speedup.json"
    path.write_text(json.dumps(result([0.97, 1.03, 0.97, 1.03], [1.0, 1.01, 0.99, 1.0], levels=("32",))))
    assert main([str(path), "--resamples", "200", "--resolution", "0.005"]) == 0
    out = capsys.readouterr().out
    assert "dspark: repeats a cell needs for ±0.5% on the all-workloads mean (throughput): c = 32: " in out
    assert "(has 4)" in out
    assert main([str(path), "--resamples", "200"]) == 0
    assert "repeats a cell needs" not in capsys.readouterr().out
    for bad, why in (("0", "must lie between 0 and 1"), ("-0.01", "must lie between 0 and 1"),
                     ("1.5", "must lie between 0 and 1"), ("half", "expected a number")):
        with pytest.raises(SystemExit):
            main([str(path), "--resolution", bad])
        assert why in capsys.readouterr().err


def test_the_median_view_reads_each_cell_at_its_median_repeat():
    # two repeats at 0.99 and one slow one: the mean says 0.952, the median 0.990
    runs = [result([0.99, 0.99, 0.88], [1.0, 1.0, 1.0], levels=("32",))]
    mean_text, _ = table(runs, "dspark", resamples=500)
    median_text, _ = table(runs, "dspark", resamples=500, median=True)
    assert "| coding.eval | **0.952 (" in mean_text
    assert "| coding.eval | **0.990 (" in median_text
    assert "all workloads (geometric mean of the medians) | **0.990 (" in median_text
    assert "all workloads (geometric mean) |" in mean_text


def test_the_median_flag_says_which_centre_the_cells_hold(tmp_path, capsys):
    path = tmp_path / "speedup.json"
    path.write_text(json.dumps(result([0.99, 0.99, 0.88], [1.0, 1.0, 1.0], levels=("32",))))
    assert main([str(path), "--resamples", "200", "--median"]) == 0
    out = capsys.readouterr().out
    assert "Each cell: the median of every run's" in out and "0.990 (" in out
    assert main([str(path), "--resamples", "200"]) == 0
    assert "Each cell: the geometric mean of every run's" in capsys.readouterr().out


@pytest.mark.parametrize("tool", ["exploration_cost", "draft_step_cost", "step_split", "run_kinds"])
def test_every_row_tool_explains_itself(tool, capsys):
    """``--help`` of each tool built on ``row_tool_main`` prints its usage and exits 0. Until session 58 the
    tools without a second view crashed there (argparse refuses to format an empty exclusive group)."""
    import importlib

    module = importlib.import_module(f"bench.{tool}")
    with pytest.raises(SystemExit) as exit_:
        module.main(["--help"])
    assert exit_.value.code == 0
    assert f"python -m bench.{tool}" in capsys.readouterr().out
