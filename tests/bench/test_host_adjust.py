"""bench.host_adjust: the A/A fit of throughput ratio on host ratio, and the correction of resting runs only."""
import json
import math

import pytest

from bench.host_adjust import AA_ROW, REST_SHARE, corrected, fit, fit_runs, log_pairs, main, table
from bench.speedup_pool import PoolError

SLOPE = -0.4


def timed(tok_s: float, host_ms: float, drafted: int = 0, steps: int = 100, tokens: int = 400) -> dict:
    """A timed run as ``bench speedup`` records it: ``host_ms`` of output + commit a step."""
    return {"throughput_tok_s": tok_s, "tokens": tokens, "steps": steps,
            "phase_ms_per_step": {"output": host_ms * 0.75, "commit": host_ms * 0.25},
            "step_kinds": {"draft": {"steps": drafted}, "plain": {"steps": steps - drafted}}}


def result(cells: int = 12, row_runs=None, aa: bool = True) -> dict:
    """A result whose A/A row's ratio is exactly host ratio ** SLOPE, cell by cell (host 1.0 to 1.55)."""
    workloads = {}
    for i in range(cells):
        host = 1.0 + 0.05 * i
        rows = {"none": {"runs": [timed(1000.0, 0.1)]}}
        if aa:
            rows[AA_ROW] = {"runs": [timed(1000.0 * host ** SLOPE, 0.1 * host)]}
        if row_runs:
            rows["dspark"] = {"runs": [row_runs(i)]}
        workloads[f"w{i // 3}"] = {**workloads.get(f"w{i // 3}", {}), str(1 << (i % 3)): {"rows": rows}}
    return {"workloads": workloads}


def test_the_fit_finds_the_slope_the_runs_were_made_with():
    f = fit_runs([result(), result()])
    assert f.pairs == 24
    assert f.slope == pytest.approx(SLOPE)
    assert f.r2 == pytest.approx(1.0) and f.sd_left == pytest.approx(0.0, abs=1e-9) and f.sd > 0.01
    # noise the host does not explain stays in what is left
    noisy = fit([(0.01 * i, SLOPE * 0.01 * i + (0.02 if i % 2 else -0.02)) for i in range(30)])
    assert noisy.r2 < 0.9 and noisy.sd_left == pytest.approx(0.02, rel=0.05)


def test_resting_runs_are_corrected_and_drafting_runs_are_left_alone():
    def dspark(i):   # a resting run on a host 1.5x slower, then a drafting one with the same numbers
        return timed(1000.0 * 1.5 ** SLOPE, 0.15, drafted=int(REST_SHARE * 100) if i % 2 == 0 else 50)
    runs, f = [result(row_runs=dspark)], fit_runs([result(cells=24)])
    cells = corrected(log_pairs(runs, "dspark"), f)
    rest, drafting = cells[("w0", "1")], cells[("w0", "2")]
    assert math.exp(rest[0][0]) == pytest.approx(1.5 ** SLOPE)        # raw: 0.85, the slow host's
    assert math.exp(rest[0][1]) == pytest.approx(1.0)                # corrected: level with `none`
    assert drafting[0][1] is None
    text = table(runs, "dspark", f)
    assert "0.850 → **1.000**" in text and "0.850 (drafted)" in text
    assert "`dspark`: 6 resting cells of 12; corrected below < 0.99: 0" in text
    # pooled by concurrency: the resting repeats only, each corrected to 1.0
    assert "| `dspark` | 1.0000 ± 0.0000 (n 2) | 1.0000 ± 0.0000 (n 2) | 1.0000 ± 0.0000 (n 2) |" in text
    assert "| `none-aa` | 1.0000 ± 0.0000 (n 4) |" in text


def test_too_few_pairs_or_no_aa_row_is_a_clear_error(tmp_path, capsys):
    with pytest.raises(PoolError, match="a fit needs 20"):
        fit_runs([result(cells=6)])
    with pytest.raises(PoolError, match="0 A/A pairs"):       # runs without the A/A row are skipped, not fatal
        fit_runs([result(aa=False, row_runs=lambda i: timed(900.0, 0.1))])
    path = tmp_path / "speedup.json"
    path.write_text(json.dumps(result(cells=6, row_runs=lambda i: timed(900.0, 0.1))))
    with pytest.raises(SystemExit) as e:
        main([str(path)])
    assert e.value.code == 2 and "--fit-from" in capsys.readouterr().err
    fit_path = tmp_path / "fit.json"
    fit_path.write_text(json.dumps(result(cells=24)))
    assert main([str(path), "--fit-from", str(fit_path)]) == 0
    assert "Fit on 24 A/A pairs: slope -0.400" in capsys.readouterr().out


def test_the_speedup_table_line_corrects_with_the_fixed_slope_and_shows_the_runs_own():
    """``host_line`` (printed under ``bench speedup``'s table) corrects by ``HISTORY``'s slope, not the run's
    own fit, so a run's A/A row is judged out of sample; without an A/A row it prints nothing."""
    from bench.host_adjust import HISTORY, host_line

    # a resting dspark run on a host 1.5x slower, whose raw ratio is what HISTORY's slope predicts: corrected 1.0
    line = host_line(result(cells=24, row_runs=lambda i: timed(1000.0 * 1.5 ** HISTORY.slope, 0.15)), "dspark")
    assert line.startswith("With the host's speed taken out (`bench.host_adjust`, slope -0.384 from 640 earlier")
    assert "this run's 24 A/A pairs alone give -0.400" in line           # the runs were made with SLOPE
    assert "dspark's 24 resting cells of 24; corrected below < 0.99: 0" in line
    # the A/A row made with SLOPE = -0.4, corrected with -0.384: ratio h ** -0.016, below 0.99 for h > 1.87 (6 cells)
    assert "the A/A row's 24 resting cells of 24; corrected below < 0.99: 6" in line
    assert host_line(result(cells=24, aa=False, row_runs=lambda i: timed(900.0, 0.1)), "dspark") == ""
