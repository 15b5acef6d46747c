"""bench.ttft_table: mean/p95 TTFT against a baseline and per-turn cells, from a part file's raw records."""
from __future__ import annotations

import gzip
import json

import pytest

from bench.ttft_table import TableError, by_turn, load_requests, main, summary


def rec(config, ttft, turn=0, prompt=100, cached=0, error=None):
    return {"config": config, "ttft_s": ttft, "turn": turn, "prompt_tokens": prompt, "cached_tokens": cached,
            "error": error}


RECORDS = [rec("prefix-lru", 0.2), rec("prefix-lru", 0.4, turn=1, cached=50),
           rec("ours", 0.1, cached=100), rec("ours", 0.1, turn=1, cached=100),
           rec("ours", None, error="timeout")]


def test_summary_ratios_are_baseline_over_config():
    lines = summary(RECORDS, "prefix-lru").splitlines()
    assert lines[2].startswith("| prefix-lru | 2/2 | 300 | 300 | 390 | 398 | 1.00× | 1.00× | 25.0% |")
    assert lines[3].startswith("| ours | 2/3 | 100 | 100 | 100 | 100 | 3.00× | 3.90× | 100.0% |")
    with pytest.raises(TableError):
        summary(RECORDS, "standard")


def test_by_turn_and_the_command_on_a_gzipped_part(tmp_path, capsys):
    assert "| ours | 0.1k/0.1k, 100 ms | 0.1k/0.1k, 100 ms |" in by_turn(RECORDS)
    path = tmp_path / "agentic.json.gz"
    with gzip.open(path, "wt") as f:
        json.dump({"steps": {"agentic": {"requests": RECORDS}}}, f)
    assert len(load_requests(path, "agentic")) == 5
    assert main([str(path), "--step", "agentic", "--turns"]) == 0
    assert "turn 1" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        main([str(path), "--step", "missing"])


def test_breakdown_splits_the_mean_ttft():
    from bench.ttft_table import breakdown

    records = [dict(rec("ours", 0.30, turn=1), engine_ttft_s=0.25, engine_queue_s=0.10, engine_parked_s=0.06),
               dict(rec("ours", 0.10, turn=1), engine_ttft_s=0.05, engine_queue_s=0.00, engine_parked_s=0.0),
               dict(rec("old", 0.20), engine_ttft_s=0.15)]       # a record from before the split
    table = breakdown(records)
    assert "| ours |  | 50 / 50 (30) / 100 |" in table     # turn 0 empty, turn 1 split
    assert "| old | 50 |  |" in table


def test_throughput_pairs_each_repeat_with_the_baselines(tmp_path, capsys):
    def cell(per_repeat, tokens, wall):
        return {"32": {"repeats": [{"output_tok_s": v} for v in per_repeat], "completion_tokens": tokens,
                       "wall_time_s": wall}}

    results = {"configs": {"standard": cell([100.0, 200.0, 100.0], 4000, 20.0),
                           "ours": cell([99.0, 150.0, 110.0], 3600, 20.0)}}
    path = tmp_path / "unique.json"
    path.write_text(json.dumps({"steps": {"unique": {"results": results, "requests": []}}}))
    assert main([str(path), "--step", "unique", "--baseline", "standard", "--throughput"]) == 0
    out = capsys.readouterr().out
    assert "| ours | 32 | 180 | 0.900 | 0.990 (0.750-1.100) |" in out     # summed 180/200; ratios .99 .75 1.1
    assert "| ours | 32 | 1 | 3 | 0.9348 |" in out               # one run's interval too: (.99 * .75 * 1.1) ** (1/3)
    with pytest.raises(SystemExit):
        main([str(path), "--step", "unique", "--baseline", "prefix-lru", "--throughput"])


def test_pooled_throughput_over_runs_is_the_geometric_mean_of_every_repeat(tmp_path, capsys):
    import math
    from bench.ttft_table import pooled

    def run(ours, base):
        def cell(values):
            return {"32": {"repeats": [{"output_tok_s": v} for v in values], "completion_tokens": sum(values),
                           "wall_time_s": 1.0}}
        return {"configs": {"standard": cell(base), "ours": cell(ours)}}

    runs = [run([50.0, 98.0], [100.0, 100.0]), run([75.0, 101.0], [50.0, 100.0])]   # not the arithmetic mean
    table = pooled(runs, "standard", resamples=2000)
    want = math.exp(sum(map(math.log, [0.5, 0.98, 1.5, 1.01])) / 4)
    row = next(line for line in table.splitlines() if line.startswith("| ours |"))
    cells = [c.strip() for c in row.split("|")[1:-1]]
    assert cells[:4] == ["ours", "32", "2", "4"] and float(cells[4]) == pytest.approx(want, abs=1e-4)
    lo, hi = map(float, cells[5].split("-"))
    assert 0.5 <= lo < want < hi <= 1.5                       # the interval lies within the ratios' range
    paths = []
    for i, results in enumerate(runs):
        paths.append(tmp_path / f"u{i}.json")
        paths[-1].write_text(json.dumps({"steps": {"unique": {"results": results, "requests": []}}}))
    assert main([*map(str, paths), "--step", "unique", "--baseline", "standard", "--throughput"]) == 0
    assert "| ours | 32 | 2 | 4 |" in capsys.readouterr().out
    with pytest.raises(SystemExit):                           # several files are for --throughput only
        main([*map(str, paths), "--step", "unique"])


def test_intervals_resample_whole_sessions_with_one_draw_for_every_config(tmp_path, capsys):
    from bench.ttft_table import intervals

    def session(sid, base_ms, ours_ms, n=20):
        return [dict(rec(c, ms / 1e3), script_id=sid) for c, ms in
                (("prefix-lru", base_ms), ("copy", base_ms), ("ours", ours_ms)) for _ in range(n)]

    records = session("a", 200.0, 100.0) + session("b", 400.0, 100.0)   # ours: 2x in a, 4x in b; 3x pooled
    rows = {line.split("|")[1].strip(): [c.strip() for c in line.split("|")[1:-1]]
            for line in intervals([records], "prefix-lru").splitlines()[2:]}
    assert rows["ours"][1:4] == ["1", "2", "40"] and rows["ours"][4].startswith("3.00× (")
    # every draw is aa, ab or bb: whole sessions give 2x and 4x at the ends (requests one by one would not)
    assert rows["ours"][4] == "3.00× (2.00-4.00)"
    # drawn together with the baseline, a config equal to it is 1x in every resample
    assert rows["copy"][4] == "1.00× (1.00-1.00)" and rows["copy"][5] == "1.00× (1.00-1.00)"
    paths = []
    for i in range(2):                                        # two runs of the step: printed each, then pooled
        paths.append(tmp_path / f"a{i}.json")
        paths[-1].write_text(json.dumps({"steps": {"agentic": {"requests": records}}}))
    assert main([*map(str, paths), "--step", "agentic"]) == 0
    out = capsys.readouterr().out
    assert out.count("| ours | 40/40 |") == 2 and "| ours | 2 | 4 | 80 | 3.00× (" in out
    with pytest.raises(SystemExit):                           # per-turn tables are for one run
        main([*map(str, paths), "--step", "agentic", "--turns"])
