"""bench.step_split: a row's time against `none`, prompt steps apart from decode steps."""
from __future__ import annotations

import json

import pytest

from bench.speedup_pool import PoolError
from bench.step_split import cell_splits, main, split


def run(wall_ms, prompt, plain, draft=(0, 0.0, 0), drafted=0):
    """A run record: (steps, ms, tokens) per step kind."""
    kinds = {"prompt": dict(zip(("steps", "ms", "tokens"), prompt)),
             "plain": dict(zip(("steps", "ms", "tokens"), plain))}
    if draft[0]:
        kinds["draft"] = dict(zip(("steps", "ms", "tokens"), draft))
    return {"wall_s": wall_ms / 1000, "step_kinds": kinds, "gate_drafted_by": {"winner": drafted}}


# `none`: 16 prompt steps (7 ms each, 232 tokens) and 179 plain ones (2.3 ms, 2,840 tokens), 5 ms outside steps
NONE = run(529.7, (16, 112.0, 232), (179, 412.7, 2840))
# drafting: 37 prompt steps of 6.5 ms, 40 drafting steps that emit 2,640 tokens in 264 ms (10 tok/ms against
# `none`'s 6.88), 20 plain ones; same tokens in all (3,072), 6 ms outside steps
DRAFTING = run(556.5, (37, 240.5, 392), (20, 46.0, 40), draft=(40, 264.0, 2640), drafted=40)


def test_a_split_puts_the_extra_prompt_steps_apart_from_the_decode_steps():
    s = split(NONE, DRAFTING)
    assert s["ratio"] == pytest.approx(529.7 / 556.5)
    assert s["prompt_steps"] == (16, 37) and s["drafted"] == 40
    assert s["prompt_ms"] == pytest.approx(128.5)
    assert s["decode_ms"] == pytest.approx(310.0 - 412.7)
    assert s["outside_ms"] == pytest.approx(1.0)
    assert s["decode_rate_ratio"] == pytest.approx((2680 / 310.0) / (2840 / 412.7))
    # at `none`'s prompt steps (112 ms instead of 240.5), the 160 extra tokens the row's prompt steps emitted
    # made by its decode steps at 2,680 / 310 tok/ms: 556.5 − 240.5 + 112 + 18.5 = 446.5 ms, 1.19x
    assert s["ratio_at_base_prompts"] == pytest.approx(529.7 / (556.5 - 240.5 + 112.0 + 160 / (2680 / 310.0)))
    assert 1.18 < s["ratio_at_base_prompts"] < 1.19


def test_the_command_pools_repeats_per_cell_and_refuses_runs_without_step_kinds(tmp_path, capsys):
    result = {"workloads": {"extraction.eval": {"16": {"rows": {"none": {"runs": [NONE, NONE]},
                                                                "dspark": {"runs": [DRAFTING, DRAFTING]}}}}}}
    path = tmp_path / "speedup.json"
    path.write_text(json.dumps(result))
    assert main([str(path)]) == 0
    out = capsys.readouterr().out
    assert "| extraction.eval | 16 | 2 | 40.0 | 0.952 | 16 → 37 | +128.5 | -102.7 | +1.0 | 1.256 | 1.186 |" in out
    assert len(cell_splits([result], "dspark")[0][2]) == 2
    old = {"workloads": {"w": {"1": {"rows": {"none": {"runs": [{"wall_s": 1.0}]},
                                              "dspark": {"runs": [{"wall_s": 1.0}]}}}}}}
    with pytest.raises(PoolError, match="step_kinds"):
        cell_splits([old], "dspark")
    with pytest.raises(SystemExit):
        main([str(path), "--row", "eagle3"])


def test_step_costs_say_what_nones_runs_are_made_of(tmp_path, capsys):
    result = {"workloads": {"extraction.eval": {"32": {"rows": {"none": {"runs": [NONE, NONE]},
                                                                "dspark": {"runs": [DRAFTING, DRAFTING]}}}}}}
    path = tmp_path / "speedup.json"
    path.write_text(json.dumps(result))
    assert main([str(path), "--step-costs"]) == 0
    # 16 prompt steps of 7.00 ms, 179 plain of 412.7 / 179 = 2.31 ms; 112 of 529.7 ms in prompt steps: 21%
    assert "| extraction.eval | 32 | 2 | 16 | 7.00 | 179 | 2.31 | 21% |" in capsys.readouterr().out


def with_phases(record: dict, phases: dict[str, tuple[float, float]]) -> dict:
    """``record`` with (schedule_ms, forward_ms) for the named step kinds, as bench speedup records them."""
    kinds = {k: dict(v) for k, v in record["step_kinds"].items()}
    for kind, (schedule, forward) in phases.items():
        kinds[kind].update(schedule_ms=schedule, forward_ms=forward)
    return {**record, "step_kinds": kinds}


def test_phases_split_prompt_and_decode_steps_by_phase_and_refuse_runs_without_them(tmp_path, capsys):
    base = with_phases(NONE, {"prompt": (16.0, 88.0), "plain": (179 * 0.3, 179 * 1.8)})
    # the row: 37 prompt steps, schedule 37 × 0.5 ms, forward 37 × 5.5; decode: 40 draft + 20 plain steps
    row = with_phases(DRAFTING, {"prompt": (18.5, 203.5), "draft": (40 * 1.5, 40 * 5.0), "plain": (20 * 0.3, 20 * 1.9)})
    result = {"workloads": {"knowledge.eval": {"32": {"rows": {"none": {"runs": [base, base]},
                                                               "dspark": {"runs": [row, row]}}}}}}
    path = tmp_path / "speedup.json"
    path.write_text(json.dumps(result))
    assert main([str(path), "--phases"]) == 0
    out = capsys.readouterr().out
    # prompt: none 16 / 16 = 1.000 ms schedule, 88 / 16 = 5.500 forward, 112 / 16 − 6.5 = 0.500 rest; the row
    # 0.500, 5.500, 240.5 / 37 − 6.0 = 0.500. Decode: none 0.300, 1.800, 412.7 / 179 − 2.1; the row
    # (60 + 6) / 60 = 1.100, (200 + 38) / 60, 310 / 60 − 1.1 − 3.967
    dec_rest_none, dec_fwd_row = 412.7 / 179 - 2.1, 238 / 60
    want = (f"| knowledge.eval | 32 | 2 | 1.000 → 0.500 | 5.500 → 5.500 | 0.500 → 0.500 | 0.300 → 1.100 | "
            f"1.800 → {dec_fwd_row:.3f} | {dec_rest_none:.3f} → {310 / 60 - 1.1 - dec_fwd_row:.3f} |")
    assert want in out
    result["workloads"]["knowledge.eval"]["32"]["rows"]["none"]["runs"] = [NONE, NONE]   # before session 45
    path.write_text(json.dumps(result))
    with pytest.raises(SystemExit):
        main([str(path), "--phases"])
    assert "since session 45" in capsys.readouterr().err
