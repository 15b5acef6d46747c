"""`python -m bench speedup` end to end on stories260K with the committed DSpark drafter (CPU, tiny sizes):
every (workload, concurrency, row) cell is present, ratios are row / none of the same repeat, and the
never-slower verdict follows the scheduled row's ratios. Plus the pure summaries on hand-made runs."""
from __future__ import annotations

import json
from collections import Counter
import os
import math
from pathlib import Path

import pytest

from bench.__main__ import main as bench_main
from bench.speedup import (AUTO_NOTES, BASELINE, SCHEDULED, RunResult, gc_line, gc_split, geomean, repeat_order,
                           requests_for, summarize_cell)
from bench.workloads.format import Message, Sampling, Session, Turn, write_sessions

REPO = Path(__file__).resolve().parents[2]
MODEL = REPO / "models" / "stories260K.gguf"
DRAFTER = REPO / "models" / "drafters" / "stories260K-dspark"
OPENINGS = ["Once upon a time, there was a", "Tom had a big dog. The dog", "One day, Lily went to the",
            "The sun was hot and"]


def _sessions(path: Path, workload: str, temperature: float) -> Path:
    write_sessions(path, [Session(id=f"{workload}{i}", workload=workload, split="eval", arrival_s=0.0,
                                  turns=[Turn(messages=[Message(role="user", content=t)], max_tokens=64)],
                                  sampling=Sampling(temperature=temperature))
                          for i, t in enumerate(OPENINGS)]
                   + [Session(id=f"{workload}-train", workload=workload, split="train", arrival_s=0.0,
                              turns=[Turn(messages=[Message(role="user", content="x")], max_tokens=4)],
                              sampling=Sampling(temperature=0.0))])
    return path


def _run(rate: float, per_user: float | None = None, tau: float | None = None, lengths=None) -> RunResult:
    return RunResult(wall_s=1.0, tokens=int(rate), throughput_tok_s=rate, per_user_tok_s=per_user or rate, steps=10,
                     verifications=0, drafted=0, accepted=0, tau=tau, mean_verified=None, admission_ms_per_step=0.1,
                     scheduler_ms_per_step=0.0, scheduled_lengths=lengths or {})


def test_each_row_runs_once_in_each_position_over_as_many_repeats():
    rows = ["none", "none-aa", "dspark", "dspark-g7"]
    orders = [repeat_order(rows, rep) for rep in range(4)]
    assert orders[0] == rows and all(sorted(o) == sorted(rows) for o in orders)
    for row in rows:
        assert sorted(o.index(row) for o in orders) == [0, 1, 2, 3]
    assert repeat_order(rows, 5) == orders[1]


def test_summaries_ratio_per_repeat_and_verdict():
    runs = {BASELINE: [_run(100), _run(50)], SCHEDULED: [_run(120, lengths={"0": 2, "3": 1}), _run(45, lengths={"3": 4})],
            "ngram": [_run(200), _run(100)]}
    cell = summarize_cell(runs)
    assert cell["rows"][SCHEDULED]["throughput_ratio"]["per_repeat"] == pytest.approx([1.2, 0.9])
    assert cell["rows"][SCHEDULED]["throughput_ratio"]["p50"] == pytest.approx(1.05)
    assert cell["rows"]["ngram"]["throughput_ratio"]["min"] == pytest.approx(2.0)
    assert cell["never_slower"] is True
    assert cell["scheduled_length_histogram"] == {"0": 2, "3": 5}
    runs[SCHEDULED][0] = _run(80)
    assert summarize_cell(runs)["never_slower"] is False
    assert summarize_cell(runs, tolerance=0.2)["never_slower"] is True
    assert geomean([2.0, 0.5]) == pytest.approx(1.0)


def test_noise_floor_counts_the_cells_a_row_fails_and_its_worst():
    """The never-slower rule applied to any row, cell by cell: the A/A row's count is the rule's noise floor."""
    from bench.speedup import noise_floor

    def cell(aa_rate, aa_user, s_rate):
        return summarize_cell({BASELINE: [_run(100)], "none-aa": [_run(aa_rate, per_user=aa_user)],
                               SCHEDULED: [_run(s_rate)]})
    result = {"workloads": {"a": {"1": cell(101, 101, 97), "4": cell(99, 101, 102)},
                            "b": {"1": cell(100, 98, 100)}}}
    assert noise_floor(result, "none-aa") == {"cells": 3, "failed": 2, "worst": pytest.approx(0.98)}
    assert noise_floor(result, SCHEDULED) == {"cells": 3, "failed": 1, "worst": pytest.approx(0.97)}
    assert noise_floor(result, SCHEDULED, tolerance=0.05)["failed"] == 0
    assert noise_floor(result, "ngram") is None


@pytest.mark.slow
def test_speedup_end_to_end_on_stories(tmp_path):
    greedy = _sessions(tmp_path / "stories-greedy.jsonl", "greedy", 0.0)
    sampled = _sessions(tmp_path / "stories-t1.jsonl", "sampled", 1.0)
    out = tmp_path / "out"
    rc = bench_main(["speedup", "--model", str(MODEL), "--drafters", f"dspark={DRAFTER}",
                     "--workloads", f"{greedy},{sampled}", "--concurrency", "1,3", "--requests", "3",
                     "--max-tokens", "12", "--repeats", "2", "--warmup-tokens", "2", "--out", str(out)])
    assert rc == 0
    result = json.loads((out / "speedup.json").read_text())
    assert result["rows"] == ["none", "none-aa", "dspark", "dspark-g7", "ngram", "ngram-gated", "dspark-g7-gated",
                              "auto"]
    assert result["skipped_rows"] == ["dflash-g7", "eagle3"]            # no drafter given for them
    assert result["fused_elementwise"] is False                         # the torch norms and rotary (CPU)
    assert result["gc"] == "freeze"             # the heap frozen after each cell's warm-ups, as specd does
    assert result["device"] == "cpu"            # the card's name on CUDA (bench.speedup_pool pools one card)
    md = (out / "speedup.md").read_text()
    assert f"Model `{MODEL}` on cpu;" in md
    assert "Garbage-collector passes in timed runs (--gc freeze): generation 2: " in md
    assert "Host drift (output and commit ms per step over the row's fastest repeat of the cell), timed runs of 64:" in md
    assert result["cpus"] is None                # unpinned unless --cpus
    assert result["row_settings"]["ngram-gated"]["spec_schedule"] == "gated"
    assert result["row_settings"]["auto"] == {"speculation": "auto", "spec_schedule": None,
                                              "num_speculative_tokens": None}
    assert result["row_settings"]["dspark-g7"] == {"speculation": "dspark", "spec_schedule": "fixed",
                                                   "num_speculative_tokens": 7}
    assert set(result["workloads"]) == {"stories-greedy", "stories-t1"}
    for cells in result["workloads"].values():
        assert set(cells) == {"1", "3"}
        for cell in cells.values():
            assert set(cell["rows"]) == set(result["rows"])
            base = cell["rows"]["none"]["runs"]
            for row, r in cell["rows"].items():
                assert len(r["runs"]) == 2
                want = [x["throughput_tok_s"] / b["throughput_tok_s"] for x, b in zip(r["runs"], base)]
                assert r["throughput_ratio"]["per_repeat"] == pytest.approx(want)
                assert r["throughput_ratio"]["min"] <= r["throughput_ratio"]["p50"] <= r["throughput_ratio"]["max"]
                assert all(0 < x["tokens"] <= 3 * 12 for x in r["runs"])        # 3 requests of ≤ 12 tokens
                for x in r["runs"]:       # every step has one kind; the kinds' tokens are the run's tokens
                    kinds = x["step_kinds"]
                    assert sum(k["steps"] for k in kinds.values()) == x["steps"]
                    assert sum(k["tokens"] for k in kinds.values()) == x["tokens"]
                    assert kinds["prompt"]["steps"] >= 1 and all(k["ms"] > 0 for k in kinds.values())
                    assert all(0 < k["schedule_ms"] + k["forward_ms"] <= k["ms"] for k in kinds.values())
                    phases = x["draft_phases"]        # the drafting steps again: a phase's first and the others
                    for what in ("steps", "tokens"):
                        assert sum(p[what] for p in phases.values()) == kinds.get("draft", {}).get(what, 0)
                    assert all(p["schedule_ms"] + p["forward_ms"] <= p["ms"] for p in phases.values())
                    assert all(p["gate_ms"] + p["propose_ms"] <= p["schedule_ms"] for p in phases.values())
                    assert not phases or phases["draft_first"]["steps"] >= 1     # a run's first drafting step opens one
                    # every request finished once: by a reason, in a step with as many others as its cohort says
                    assert sum(x["finish_reasons"].values()) == 3 and set(x["finish_reasons"]) <= {"length", "stop"}
                    assert sum(int(n) * k for n, k in x["finish_cohorts"].items()) == 3
                    # each request once, by prompt index, with the tokens the run counted
                    assert sorted(i for i, _, _, _ in x["requests"]) == [0, 1, 2]
                    assert sum(n for _, n, _, _ in x["requests"]) == x["tokens"]
                    ran = Counter(m for *_, m in x["requests"])      # the method each request ran
                    if row == "auto":     # the methods its chooser gave (``auto_methods``), request by request
                        assert ran == {m: n for m, n in x["auto_methods"].items() if m not in AUTO_NOTES}
                    else:
                        assert ran == {result["row_settings"][row]["speculation"]: 3}
                    assert set(x["gc_pauses"]) <= {"gen0", "gen1", "gen2"}
                    assert all(n >= 1 and ms >= 0 for n, ms in x["gc_pauses"].values())
                    if row.startswith("none"):
                        assert "draft" not in kinds
                    # the auto row's 3 requests each went to dspark or ngram; no other row has any
                    given = {m: n for m, n in x["auto_methods"].items() if m not in AUTO_NOTES}
                    if row == "auto":
                        assert sum(given.values()) == 3 and set(given) <= {"dspark", "ngram"}
                    else:
                        assert given == {}
                if row == "none":
                    assert r["tau"] is None and r["throughput_ratio"]["p50"] == pytest.approx(1.0)
                elif row == "none-aa":      # the A/A row: the same plain decoding, timed as a row of its own
                    assert r["tau"] is None and [x["tokens"] for x in r["runs"]] == [x["tokens"] for x in base]
                elif row == "dspark-g7":
                    assert r["tau"] > 1.0 and 1.0 <= r["mean_verified"] <= 7.0
                    assert all(x["step_kinds"]["draft"]["steps"] >= 1 for x in r["runs"])
            # 12-token answers never decode EXPLORE_TOKENS a method, so every cell's chooser still explores
            # after each whole-answer warm-up, and the auto row gets all AUTO_WARMUPS of them
            assert cell["auto_extra_warmups"] == {"auto": 3}
            s = cell["rows"][SCHEDULED]
            assert cell["never_slower"] == (s["throughput_ratio"]["p50"] >= 1 and s["per_user_ratio"]["p50"] >= 1)
            # every scheduled step either went through the confidence scheduler or was rested by the
            # measured gate (which may rest the drafter for a whole short cell where drafting loses)
            rested = sum(x["gate_rested_steps"] for x in s["runs"])
            assert sum(cell["scheduled_length_histogram"].values()) > 0 or rested > 0
            assert all(0 <= int(k) <= 7 for k in cell["scheduled_length_histogram"])
    for row, levels in result["summary"].items():
        for level, s in levels.items():
            ratios = [result["workloads"][w][level]["rows"][row]["throughput_ratio"]["p50"] for w in result["workloads"]]
            assert s["throughput"] == pytest.approx(math.exp(sum(map(math.log, ratios)) / len(ratios)))
    md = (out / "speedup.md").read_text()
    assert "## stories-greedy" in md and "## Summary across workloads" in md
    assert md.count("never slower than none at concurrency") == 4
    assert md.count("  - steps per run by kind, count (ms each, tokens each): none: prompt ") == 4
    assert "- auto at concurrency 3, requests by method over the timed runs: " in md
    from bench.auto_replay import main as replay_main       # the chooser replayed on the rows' own requests
    assert replay_main([str(out / "speedup.json"), "--concurrency", "1,3"]) == 0
    choice = result["workloads"]["stories-t1"]["3"]["auto_choice_by_row"]["auto"]      # the chooser's cells
    assert {c["bucket"] for c in choice} <= {1, 2} and all(set(c["arms"]) <= {"dspark", "ngram"} for c in choice)
    assert "Timed runs that captured CUDA graphs: 0 of 64" in md          # CPU: no graphs at all (2 × 2 × 8 rows × 2)
    from bench.speedup import NOISE_BAND, noise_floor
    band, aa = noise_floor(result, SCHEDULED, NOISE_BAND), noise_floor(result, "none-aa", NOISE_BAND)
    assert (f"Within a 3% band (ratios ≥ 0.97): scheduled dspark fails in {band['failed']} of 4 cells, "
            f"the A/A row in {aa['failed']}.") in md


def test_the_beside_prompts_row_drafts_beside_a_prompt_with_a_gate_of_its_own(monkeypatch, tmp_path, step_clock):
    """dspark-beside-prompts runs scheduled dspark with the gate's drafts beside prompt chunks on, through
    a gate of its own (its cells and class records are not the dspark row's), only while its own runs
    last; it is no default row, and the dspark row keeps the engine's gate (off). The gate is made to
    draft wherever it is asked, and the engine's and the verify profile's timers are the suite's step clock
    (tests/conftest.py): the scheduled draft lengths come from that profile, timed at start-up, so what a run
    drafts varied with the machine's load, and one full-suite run in session 26 had a run of this row with
    no prompt step that drafted."""
    from bench.speedup import DEFAULT_ROWS, row_gate
    from specd.engine.spec_gate import SpecGate

    seen = []

    def always(self, method, sequences, requests, verify=None):
        seen.append(self.beside_prompts)
        return self.beside_prompts

    monkeypatch.setattr(SpecGate, "drafts_beside_prompts", always)
    monkeypatch.setattr(SpecGate, "should_draft", lambda self, *a, **k: True)
    assert "dspark-beside-prompts" not in DEFAULT_ROWS and SpecGate().beside_prompts is False
    greedy = _sessions(tmp_path / "stories-greedy.jsonl", "greedy", 0.0)
    out = tmp_path / "out"
    rc = bench_main(["speedup", "--model", str(MODEL), "--drafters", f"dspark={DRAFTER}", "--workloads", str(greedy),
                     "--concurrency", "2", "--rows", "dspark,dspark-beside-prompts", "--requests", "4",
                     "--max-tokens", "12", "--repeats", "2", "--warmup-tokens", "2", "--out", str(out)])
    assert rc == 0
    cell = json.loads((out / "speedup.json").read_text())["workloads"]["stories-greedy"]["2"]["rows"]
    assert all("prompt_draft" not in x["step_kinds"] for x in cell["dspark"]["runs"])
    assert all(x["step_kinds"]["prompt_draft"]["steps"] >= 1 for x in cell["dspark-beside-prompts"]["runs"])
    # only the row's own gate (on) was asked; the engine skips the question where the setting is off
    assert True in seen and False not in seen

    class Engine:
        spec_gate = SpecGate()

    default, own = Engine.spec_gate, {}
    with row_gate(Engine, "dspark-beside-prompts", own):       # a gate of its own, with its setting
        first = Engine.spec_gate
        assert first is not default and first.beside_prompts is True
    assert Engine.spec_gate is default and default.beside_prompts is False
    with row_gate(Engine, "dspark-beside-prompts", own):       # the same one again: kept across cells
        assert Engine.spec_gate is first
    with row_gate(Engine, "dspark", own):                      # a row without settings: the engine's
        assert Engine.spec_gate is default
    result = json.loads((out / "speedup.json").read_text())
    assert list(result["gate_trace_by_row"]) == ["dspark-beside-prompts"]
    assert "dspark-beside-prompts" in result["workloads"]["stories-greedy"]["2"]["gate_recent_by_row"]


def test_budget_cuts_cells_and_still_writes(tmp_path):
    """--budget-s 0: no cell starts, every one is listed as cut, and the report is still written."""
    allowed = sorted(os.sched_getaffinity(0))
    greedy = _sessions(tmp_path / "stories-greedy.jsonl", "greedy", 0.0)
    out = tmp_path / "out"
    rc = bench_main(["speedup", "--model", str(MODEL), "--workloads", str(greedy), "--concurrency", "1,3",
                     "--rows", "none,ngram", "--requests", "2", "--max-tokens", "4", "--repeats", "1",
                     "--budget-s", "0", "--cpus", ",".join(map(str, allowed)), "--out", str(out)])
    assert rc == 0
    result = json.loads((out / "speedup.json").read_text())
    assert result["cpus"] == allowed     # --cpus: pinned (here to every CPU it had, so the tests after run as before)
    assert result["cut"] == ["stories-greedy c=1", "stories-greedy c=3"]
    assert result["workloads"] == {"stories-greedy": {}}
    assert "Cells not run (past --budget-s): stories-greedy c=1, stories-greedy c=3." in (out / "speedup.md").read_text()


def test_profile_writes_one_table_per_row_and_concurrency(tmp_path):
    """--profile: cProfile over the timed runs only; the step function shows in every table."""
    greedy = _sessions(tmp_path / "stories-greedy.jsonl", "greedy", 0.0)
    out, prof = tmp_path / "out", tmp_path / "prof"
    rc = bench_main(["speedup", "--model", str(MODEL), "--workloads", str(greedy), "--concurrency", "1,2",
                     "--rows", "none,ngram", "--requests", "2", "--max-tokens", "4", "--repeats", "1",
                     "--profile", str(prof), "--out", str(out)])
    assert rc == 0
    names = sorted(p.name for p in prof.iterdir())
    assert names == ["profile-ngram-c1.txt", "profile-ngram-c2.txt", "profile-none-c1.txt", "profile-none-c2.txt"]
    for p in prof.iterdir():
        text = p.read_text()
        assert "## by tottime" in text and "## by cumulative" in text
        assert "(step)" in text            # engine.step ran inside the profiled window


def test_gated_rows_warm_up_until_their_gate_cells_at_this_load_and_the_lighter_ones_have_explored():
    """A new (method, load) cell explores both arms once; the warm-up repeats (at most EXTRA_WARMUPS times a
    bucket) until the row's cell at this load has, at this load, then each lighter cell a warm-up made, at
    the lighter bucket's own concurrency, so the timed runs' drains (their lighter buckets) measure the steady
    state too."""
    from types import SimpleNamespace

    from bench.speedup import EXTRA_WARMUPS, finish_exploring, gate_key
    from specd.engine.spec_gate import SpecGate

    assert [gate_key(r) for r in ("none", "dspark", "dspark-g7", "ngram-gated", "ngram")] == \
        [None, "dspark", None, "ngram_gated", None]
    gate = SpecGate(min_samples=3)
    engine = SimpleNamespace(spec_gate=gate)
    calls = []

    def warm(tag, concurrency):   # one warm-up run: four measured steps at its load, drafting slower
        calls.append((tag, concurrency))
        for _ in range(4):
            drafted = gate.should_draft("dspark", concurrency)
            gate.observe("dspark", concurrency, drafted, concurrency, concurrency / (500.0 if drafted else 1000.0))

    gate.should_draft("dspark", 32)                      # the cell exists and explores
    gate.should_draft("dspark", 2)                       # and a drain made a b2 cell
    assert gate.exploring("dspark") == [2, 32]
    # b32: 3 drafting + 3 resting steps, two runs at c = 32; b2 (b16-b4 were never made): two runs at c = 2
    assert finish_exploring(engine, "dspark", 32, warm) == {32: 2, 2: 2}
    assert [c for _, c in calls] == [32, 32, 2, 2] and calls[0][0] == "x32-0"
    assert gate.exploring("dspark") == []
    assert finish_exploring(engine, "dspark", 32, warm) == {}      # explored: nothing more
    assert finish_exploring(engine, "dspark", 24, warm) == {}      # 24 is bucket 16: its lighter ones explored
    assert finish_exploring(engine, "dspark-g7", 32, warm) == {}   # fixed γ is not gated
    assert finish_exploring(engine, "ngram-gated", 32, warm) == {}   # its cell does not exist yet
    stuck = SimpleNamespace(spec_gate=SimpleNamespace(exploring=lambda key: [1, 32]))
    calls.clear()
    assert finish_exploring(stuck, "dspark", 32, lambda tag, c: calls.append(c)) == {32: EXTRA_WARMUPS, 1: EXTRA_WARMUPS}
    assert calls == [32] * EXTRA_WARMUPS + [1] * EXTRA_WARMUPS


def test_a_cell_runs_at_least_waves_requests_per_slot():
    assert requests_for(8, 8) == 8                  # one wave: every request starts together
    assert requests_for(8, 8, waves=4) == 32
    assert requests_for(1, 8, waves=4) == 8         # --requests stays the floor
    assert requests_for(32, 8) == 32


def test_the_resting_row_never_drafts_and_torch_profile_sets_rows_side_by_side(tmp_path):
    """dspark-resting: scheduled dspark behind a gate that never drafts, captures no prompt and runs the
    steady rest, with the same outputs' lengths as `none` and no verification; it is no default row.
    --torch-profile: one table per concurrency with both rows' ops (the model's linear layers among them);
    with --profile beside it, the cProfile tables hold the runs, not the torch profiler's post-processing."""
    from bench.speedup import DEFAULT_ROWS

    assert "dspark-resting" not in DEFAULT_ROWS
    greedy = _sessions(tmp_path / "stories-greedy.jsonl", "greedy", 0.0)
    out, prof, cprof = tmp_path / "out", tmp_path / "tprof", tmp_path / "cprof"
    rc = bench_main(["speedup", "--model", str(MODEL), "--drafters", f"dspark={DRAFTER}", "--workloads", str(greedy),
                     "--concurrency", "2", "--rows", "none,dspark-resting", "--requests", "4", "--max-tokens", "12",
                     "--repeats", "1", "--warmup-tokens", "2", "--torch-profile", str(prof), "--profile", str(cprof),
                     "--out", str(out)])
    assert rc == 0
    cell = json.loads((out / "speedup.json").read_text())["workloads"]["stories-greedy"]["2"]["rows"]
    for run in cell["dspark-resting"]["runs"]:
        assert run["verifications"] == 0 and run["tokens"] == cell["none"]["runs"][0]["tokens"]
        assert run["gate_rested_steps"] > 0 and run["gate_rest_again_steps"] > 0      # the steady rest ran
        assert 0 < run["gate_rest_leased_steps"] < run["gate_rest_again_steps"]     # most of it on leases
        assert 0 < run["gate_rest_span_steps"] <= run["gate_rested_steps"]          # and in rest spans
        assert run["gate_promptless_requests"] == 4                                   # no prompt captured
        assert sum(run["gate_drafted_by"].values()) == 0
        assert run["gate_probes"] == run["gate_probes_cut"] == 0                    # recorded; it never probes
    assert sorted(p.name for p in prof.iterdir()) == ["torch-profile-c2.md"]
    text = (prof / "torch-profile-c2.md").read_text()
    assert "dspark-resting device ms" in text and "none device ms" in text
    ops = [line for line in text.splitlines() if line.startswith("| `aten::")]
    assert len(ops) >= 20                                  # the model's ops, under both tables
    for path in cprof.iterdir():                           # session 35, run DA: key_averages led its tables
        text = path.read_text()
        assert "(step)" in text and "key_averages" not in text and "profiler_util" not in text, path.name


def test_the_rejection_rows_verify_greedy_drafts_through_the_rejection_sampler(tmp_path, monkeypatch):
    """dspark-g7-rejection: the same greedy drafts verified by the rejection sampler instead of the argmax
    chain (specd/engine/greedy_verify.py), the engine's default restored after the row; the same tokens;
    no default row."""
    import kvspec_kernels as kernels
    from bench.speedup import DEFAULT_ROWS
    from specd.engine.greedy_verify import GreedyVerify

    assert "dspark-rejection" not in DEFAULT_ROWS and "dspark-g7-rejection" not in DEFAULT_ROWS
    calls = {"chain": 0, "kernel": 0}
    chain, kernel = GreedyVerify.run, kernels.rejection_sample
    monkeypatch.setattr(GreedyVerify, "run", lambda self, logits: calls.__setitem__("chain", calls["chain"] + 1)
                        or chain(self, logits))
    monkeypatch.setattr(kernels, "rejection_sample", lambda *a: calls.__setitem__("kernel", calls["kernel"] + 1)
                        or kernel(*a))
    greedy = _sessions(tmp_path / "stories-greedy.jsonl", "greedy", 0.0)
    tokens = {}
    for row in ("dspark-g7", "dspark-g7-rejection"):
        calls.update(chain=0, kernel=0)
        out = tmp_path / row
        rc = bench_main(["speedup", "--model", str(MODEL), "--drafters", f"dspark={DRAFTER}", "--workloads", str(greedy),
                         "--concurrency", "2", "--rows", f"none,{row}", "--requests", "2", "--max-tokens", "10",
                         "--repeats", "1", "--warmup-tokens", "2", "--out", str(out)])
        assert rc == 0
        run = json.loads((out / "speedup.json").read_text())["workloads"]["stories-greedy"]["2"]["rows"][row]["runs"][0]
        assert run["verifications"] > 0
        tokens[row] = run["tokens"]
        if row == "dspark-g7":
            assert calls["chain"] > 0 and calls["kernel"] == 0
        else:
            assert calls["chain"] == 0 and calls["kernel"] > 0
    assert tokens["dspark-g7"] == tokens["dspark-g7-rejection"]


def test_the_eagle3_eager_row_drafts_without_its_graphs_and_puts_them_back():
    """eagle3-eager: while the row runs, the eagle3 proposer has no draft graphs (the eager
    ``draft_contexts``); after it, and after a failed run, they are back; the `eagle3` row keeps them.
    Not a default row."""
    from types import SimpleNamespace

    from bench.speedup import DEFAULT_ROWS, row_gate
    from specd.engine.spec_gate import SpecGate

    assert "eagle3-eager" not in DEFAULT_ROWS and "eagle3" in DEFAULT_ROWS
    graphs = object()
    proposer = SimpleNamespace(rounds=graphs)
    gate = SpecGate()
    engine = SimpleNamespace(spec_gate=gate, greedy_chain=True, _proposer=lambda method: proposer)
    own: dict = {}
    with row_gate(engine, "eagle3-eager", own):
        assert proposer.rounds is None and engine.spec_gate is own["eagle3-eager"]
    assert proposer.rounds is graphs and engine.spec_gate is gate
    with pytest.raises(RuntimeError), row_gate(engine, "eagle3-eager", own):
        raise RuntimeError("a failed run")
    assert proposer.rounds is graphs
    with row_gate(engine, "eagle3", own):
        assert proposer.rounds is graphs and engine.spec_gate is gate


def test_the_absorb_eager_row_runs_without_the_projection_graphs_and_puts_them_back():
    """dspark-absorb-eager: while the row runs, the proposer's round graphs keep no projection graphs (the
    eager ``absorb_many``) and a gate of its own decides; after it, both are the engine's again, also when the
    row fails. Not a default row."""
    from types import SimpleNamespace

    from bench.speedup import DEFAULT_ROWS, row_gate
    from specd.engine.spec_gate import SpecGate

    assert "dspark-absorb-eager" not in DEFAULT_ROWS
    graphs = object()
    proposer = SimpleNamespace(rounds=SimpleNamespace(absorbs=graphs))
    gate = SpecGate()
    engine = SimpleNamespace(spec_gate=gate, greedy_chain=True, _proposer=lambda method: proposer)
    own: dict = {}
    with row_gate(engine, "dspark-absorb-eager", own):
        assert proposer.rounds.absorbs is None
        assert engine.spec_gate is own["dspark-absorb-eager"] and engine.spec_gate is not gate
        assert engine.greedy_chain
    assert proposer.rounds.absorbs is graphs and engine.spec_gate is gate
    with pytest.raises(RuntimeError), row_gate(engine, "dspark-absorb-eager", own):
        raise RuntimeError("a failed run")
    assert proposer.rounds.absorbs is graphs and engine.spec_gate is gate
    with row_gate(engine, "dspark", own):           # the default row keeps the graphs and the engine's gate
        assert proposer.rounds.absorbs is graphs and engine.spec_gate is gate


def test_the_no_span_row_runs_without_rest_spans_and_puts_them_back():
    """dspark-no-span: while the row runs, the engine takes no rest spans and a gate of its own decides;
    after it (also when the row fails) spans are on and the gate is the engine's again. Not a default row."""
    from types import SimpleNamespace

    from bench.speedup import DEFAULT_ROWS, row_gate
    from specd.engine.spec_gate import SpecGate

    assert "dspark-no-span" not in DEFAULT_ROWS
    gate = SpecGate()
    engine = SimpleNamespace(spec_gate=gate, greedy_chain=True, rest_spans=True)
    own: dict = {}
    with row_gate(engine, "dspark-no-span", own):
        assert engine.rest_spans is False
        assert engine.spec_gate is own["dspark-no-span"] and engine.spec_gate is not gate
    assert engine.rest_spans is True and engine.spec_gate is gate
    with pytest.raises(RuntimeError), row_gate(engine, "dspark-no-span", own):
        raise RuntimeError("a failed run")
    assert engine.rest_spans is True and engine.spec_gate is gate
    with row_gate(engine, "dspark", own):
        assert engine.rest_spans is True and engine.spec_gate is gate


@pytest.mark.parametrize("row, budget, most", [("dspark-probe-full", 0.01, 1024), ("dspark-probe-quarter", 0.0025, 4096)])
def test_the_probe_budget_rows_run_behind_a_gate_of_their_own(row, budget, most):
    """dspark-probe-full (the defaults until session 31) and dspark-probe-quarter (half the default): a gate
    of its own with that probe_budget and probe_max, the engine's gate (the defaults) back after the row.
    Not default rows."""
    from types import SimpleNamespace

    from bench.speedup import DEFAULT_ROWS, row_gate
    from specd.engine.spec_gate import PROBE_BUDGET, PROBE_MAX, SpecGate

    assert row not in DEFAULT_ROWS
    gate = SpecGate()
    engine = SimpleNamespace(spec_gate=gate, greedy_chain=True, _proposer=lambda method: SimpleNamespace(rounds=None))
    own: dict = {}
    with row_gate(engine, row, own):
        assert engine.spec_gate is not gate
        assert (engine.spec_gate.probe_budget, engine.spec_gate.probe_max) == (budget, most)
    assert engine.spec_gate is gate and (gate.probe_budget, gate.probe_max) == (PROBE_BUDGET, PROBE_MAX) == (0.005, 2048)


@pytest.mark.parametrize("row, setting, default", [("dspark-probe-uncut", "probe_cut", 2.0),
                                                   ("dspark-charge-whole", "charge_steps", 1.0),
                                                   ("dspark-clip-off", "plain_clip", 2.0)])
def test_the_old_rule_rows_run_behind_a_gate_of_their_own(row, setting, default):
    """dspark-probe-uncut: a gate of its own that never cuts a probe short (``probe_cut`` None);
    dspark-charge-whole: one that puts all held capture time on the next drafting sample (``charge_steps``
    None, as until session 39); dspark-clip-off: one that takes every plain sample as measured (``plain_clip``
    None, as until session 41). The engine's gate (the defaults) is back after the row. Not default rows."""
    from types import SimpleNamespace

    from bench.speedup import DEFAULT_ROWS, row_gate
    from specd.engine import spec_gate
    from specd.engine.spec_gate import SpecGate

    assert row not in DEFAULT_ROWS
    gate = SpecGate()
    engine = SimpleNamespace(spec_gate=gate, greedy_chain=True, _proposer=lambda method: SimpleNamespace(rounds=None))
    with row_gate(engine, row, {}):
        assert engine.spec_gate is not gate and getattr(engine.spec_gate, setting) is None
    assert engine.spec_gate is gate and getattr(gate, setting) == getattr(spec_gate, setting.upper()) == default


@pytest.mark.parametrize("row, setting, value", [("dspark-calibrated", "calibrate", True),
                                                 ("dspark-opening-priced", "steady_price", False)])
def test_a_boolean_gate_rule_row_runs_behind_a_gate_of_its_own(row, setting, value):
    """dspark-calibrated (``calibrate`` on: ``Cell.calibration``, off by default since session 53's runs) and
    dspark-opening-priced (``steady_price`` off: ``Cell.opening``, on by default since session 54's): a gate
    of its own with the rule flipped; the engine's gate keeps the default, and is back after the row. Not
    default rows."""
    from types import SimpleNamespace

    from bench.speedup import DEFAULT_ROWS, row_gate
    from specd.engine.spec_gate import SpecGate

    assert row not in DEFAULT_ROWS
    gate = SpecGate()
    engine = SimpleNamespace(spec_gate=gate, greedy_chain=True, _proposer=lambda method: SimpleNamespace(rounds=None))
    with row_gate(engine, row, {}):
        assert engine.spec_gate is not gate and getattr(engine.spec_gate, setting) is value
    assert engine.spec_gate is gate and getattr(gate, setting) is (not value)


def test_the_class_long_row_runs_behind_a_gate_whose_classes_remember_longer():
    """dspark-class-long: a gate of its own whose prompt classes keep 0.995 of their older drafting steps at
    each new one (``SpecGate.class_decay``); the engine's gate keeps the default. Not a default row."""
    from types import SimpleNamespace

    from bench.speedup import DEFAULT_ROWS, row_gate
    from specd.engine.gate_records import CLASS_DECAY
    from specd.engine.spec_gate import SpecGate

    assert "dspark-class-long" not in DEFAULT_ROWS
    gate = SpecGate()
    engine = SimpleNamespace(spec_gate=gate, greedy_chain=True, _proposer=lambda method: SimpleNamespace(rounds=None))
    with row_gate(engine, "dspark-class-long", {}):
        assert engine.spec_gate is not gate and engine.spec_gate.record("dspark", [1] * 40).group.decay == 0.995
    assert engine.spec_gate is gate and gate.record("dspark", [1] * 40).group.decay == CLASS_DECAY


def test_collector_passes_are_split_by_generation_and_summed_over_runs():
    d = {"gc_gen0_passes_total": 3, "gc_gen0_seconds_total": 0.0006, "gc_gen1_passes_total": 0,
         "gc_gen1_seconds_total": 0.0, "gc_gen2_passes_total": 1, "gc_gen2_seconds_total": 0.15}
    assert gc_split(d) == {"gen0": [3, 0.6], "gen2": [1, 150.0]}       # generations without a pass are left out
    timed = [{"gc_pauses": gc_split(d)}, {"gc_pauses": {"gen0": [2, 0.4]}}, {}]
    assert gc_line(timed, "default") == ("Garbage-collector passes in timed runs (--gc default): generation 2: "
                                         "1 passes in 1 runs, 150.0 ms; generation 1: 0 passes in 0 runs, 0.0 ms; "
                                         "generation 0: 5 passes in 2 runs, 1.0 ms.")


def test_queued_requests_wait_in_the_engine_and_the_resting_row_spans_through_them(tmp_path):
    """--queued: the engine runs at most the load at once (``max_num_seqs``, restored after) while that many
    more requests wait in its queue; every run still answers every request, the JSON records the setting,
    and the resting row's rest spans form with requests queued (``GateSteps._may_span`` vets the queue)."""
    import bench.speedup as speedup

    greedy = _sessions(tmp_path / "stories-greedy.jsonl", "greedy", 0.0)
    out = tmp_path / "out"
    seen = []
    inner = speedup.run_closed_loop

    def logged(engine, prompts, fields, concurrency, tag, queued=0):
        seen.append((concurrency, queued, engine.scheduler.max_num_seqs))
        return inner(engine, prompts, fields, concurrency, tag, queued)
    speedup.run_closed_loop = logged
    try:
        rc = bench_main(["speedup", "--model", str(MODEL), "--drafters", f"dspark={DRAFTER}", "--workloads", str(greedy),
                         "--concurrency", "1,2", "--rows", "none,dspark-resting", "--requests", "4", "--queued", "2",
                         "--max-tokens", "24", "--repeats", "1", "--warmup-tokens", "2", "--out", str(out)])
    finally:
        speedup.run_closed_loop = inner
    assert rc == 0
    assert seen and all(queued == 2 and most == level for level, queued, most in seen)
    result = json.loads((out / "speedup.json").read_text())
    assert result["queued"] == 2
    for level, cell in result["workloads"]["stories-greedy"].items():
        none, resting = cell["rows"]["none"]["runs"][0], cell["rows"]["dspark-resting"]["runs"][0]
        assert resting["tokens"] == none["tokens"] == 4 * 24
        if level == "2":
            assert resting["gate_rest_span_steps"] > 0


def test_reseeded_moves_every_seed_by_the_repeat_and_keeps_the_rest():
    from bench.speedup import Prompt, reseeded
    from specd.sampling_params import SamplingParams

    prompts = [Prompt([1, 2, i], SamplingParams(temperature=0.7, top_p=0.9, max_tokens=8, seed=10 + i))
               for i in range(3)]
    assert reseeded(prompts, 0) is prompts
    seeds = [[p.params.seed for p in reseeded(prompts, rep)] for rep in range(4)]
    assert seeds == [[10, 11, 12], [13, 14, 15], [16, 17, 18], [19, 20, 21]]     # no seed twice over repeats
    moved = reseeded(prompts, 2)
    assert [p.ids for p in moved] == [p.ids for p in prompts]
    assert all(m.params.model_dump(exclude={"seed"}) == p.params.model_dump(exclude={"seed"})
               for m, p in zip(moved, prompts))


@pytest.mark.parametrize("seeds", ["fixed", "by-repeat"])
def test_seeds_by_repeat_give_each_repeat_its_own_seeds_and_every_row_of_a_repeat_the_same(seeds, tmp_path,
                                                                                          monkeypatch):
    """--seeds by-repeat: the timed runs of repeat r sample with every seed moved by r x the cell's requests,
    the same for each row of the repeat (rows stay paired); fixed (the default): the same seeds in every
    repeat. The warm-ups keep the cell's own seeds either way. The result and its report say which."""
    import bench.speedup as speedup

    seen: dict[str, list[int]] = {}
    real = speedup.run_closed_loop

    def recording(engine, prompts, fields, level, tag, *rest):
        seen[tag] = [p.params.seed for p in prompts]
        return real(engine, prompts, fields, level, tag, *rest)

    monkeypatch.setattr(speedup, "run_closed_loop", recording)
    sampled = _sessions(tmp_path / "stories-t1.jsonl", "sampled", 1.0)
    out = tmp_path / "out"
    rc = bench_main(["speedup", "--model", str(MODEL), "--workloads", str(sampled), "--concurrency", "2",
                     "--rows", "none,ngram", "--requests", "4", "--max-tokens", "4", "--repeats", "3",
                     "--warmup-tokens", "2", "--seeds", seeds, "--seed", "5", "--out", str(out)])
    assert rc == 0
    base = [5, 6, 7, 8]
    for rep in range(3):
        want = [s + (4 * rep if seeds == "by-repeat" else 0) for s in base]
        assert seen[f"stories-t1-2-none-{rep}"] == seen[f"stories-t1-2-ngram-{rep}"] == want
    assert all(v == base for tag, v in seen.items() if tag.startswith("warm-"))
    assert json.loads((out / "speedup.json").read_text())["seeds"] == seeds
    assert ("seeds moved each repeat (--seeds by-repeat)" in (out / "speedup.md").read_text()) == (seeds == "by-repeat")


@pytest.mark.parametrize("row, most", [("dspark-capture-prompts", 8), ("dspark-capture-prompts-32", 32)])
def test_the_capture_prompts_rows_run_behind_a_gate_of_their_own(row, most):
    """dspark-capture-prompts(-32): a gate of its own whose prompts capture at loads up to 8 (32) whatever the
    cell decides (``capture_prompts``), the engine's gate (off) back after the row; its runs record the prompts
    it captured that way. Not default rows."""
    from types import SimpleNamespace

    from bench.speedup import DEFAULT_ROWS, RunResult, row_gate
    from specd.engine.spec_gate import SpecGate

    assert row not in DEFAULT_ROWS
    gate = SpecGate()
    engine = SimpleNamespace(spec_gate=gate, greedy_chain=True, _proposer=lambda method: SimpleNamespace(rounds=None))
    with row_gate(engine, row, {}):
        assert engine.spec_gate is not gate and engine.spec_gate.capture_prompts == most
        assert engine.spec_gate.captures_prompt(most) and not engine.spec_gate.captures_prompt(2 * most)
    assert engine.spec_gate is gate and gate.capture_prompts is None and not gate.captures_prompt(1)
    assert RunResult.__dataclass_fields__["gate_prompts_captured_anyway"].default == 0


def test_every_engine_counter_a_run_reads_is_kept_in_its_delta():
    """``_delta`` keeps only ``STAT_KEYS`` and a few prefixes; a counter read from the delta but missing there
    reads 0 in every run. Session 47: `gate_prompts_captured_anyway` was 0 in all 90 runs of the
    dspark-capture-prompts row (runs FA, FD) for that reason. Every ``d["..."]`` and ``d.get("...")`` of
    ``bench/speedup.py`` must survive ``_delta``."""
    import re
    from pathlib import Path

    import bench.speedup as speedup

    source = Path(speedup.__file__).read_text()
    read = set(re.findall(r'\bd\["([a-z0-9_]+)"\]', source)) | set(re.findall(r'\bd\.get\("([a-z0-9_]+)"', source))
    assert "spec_prompts_captured_anyway_total" in read and len(read) > 10
    after = {key: 3 for key in read}
    kept = speedup._delta({}, after)
    assert {key for key in read if kept.get(key) != 3} == set()


def test_gate_trace_steps_reach_the_engines_gate_and_the_rows_own(tmp_path):
    """--gate-trace-steps: the engine's gate and a row's own gate (``row_gate`` copies it) keep that many
    reports a cell in the JSON, past the default 16; 0 is refused."""
    from bench.speedup import row_gate
    from specd.engine.spec_gate import TRACE_STEPS, SpecGate

    class Engine:
        spec_gate = SpecGate(trace_steps=40)
        greedy_chain = True

    own = {}
    with row_gate(Engine, "dspark-capture-prompts", own):
        assert Engine.spec_gate.trace_steps == 40
    assert TRACE_STEPS == 16
    greedy = _sessions(tmp_path / "stories-greedy.jsonl", "greedy", 0.0)
    out = tmp_path / "out"
    rc = bench_main(["speedup", "--model", str(MODEL), "--drafters", f"dspark={DRAFTER}", "--workloads", str(greedy),
                     "--concurrency", "2", "--rows", "dspark,dspark-capture-prompts", "--requests", "4",
                     "--max-tokens", "12", "--repeats", "2", "--warmup-tokens", "2", "--gate-trace-steps", "200",
                     "--out", str(out)])
    assert rc == 0
    result = json.loads((out / "speedup.json").read_text())
    for traces in (result["gate_trace"], result["gate_trace_by_row"]["dspark-capture-prompts"]):
        assert max(len(reports) for reports in traces.values()) > TRACE_STEPS
    with pytest.raises(SystemExit):
        bench_main(["speedup", "--model", str(MODEL), "--drafters", f"dspark={DRAFTER}", "--workloads", str(greedy),
                    "--concurrency", "2", "--rows", "dspark", "--requests", "2", "--max-tokens", "4",
                    "--repeats", "1", "--gate-trace-steps", "0", "--out", str(tmp_path / "bad")])


def test_the_markov_ref_row_runs_the_slot_references_in_rounds_of_its_own(monkeypatch):
    """dspark-markov-ref: while the row runs, ``KVSPEC_MARKOV_SLOT=0`` is set (the slot's torch references)
    and the proposer drafts through a second DraftGraphs that shares the block and projection graphs (a
    captured graph keeps its kernels, so the variable alone would not reach the engine's rounds); the same
    second set comes back in the next cell. After the row, also when it fails, the engine's rounds, gate and
    environment are back. Not a default row."""
    from types import SimpleNamespace

    import torch

    from bench.speedup import DEFAULT_ROWS, row_gate
    from kvspec_kernels.dispatch import MARKOV_SLOT_ENV, markov_slot_kernels
    from specd.engine.draft_graphs import DraftGraphs
    from specd.engine.spec_gate import SpecGate

    assert "dspark-markov-ref" not in DEFAULT_ROWS
    monkeypatch.delenv(MARKOV_SLOT_ENV, raising=False)
    cfg = SimpleNamespace(gamma=3, vocab_size=32, hidden_size=8)
    drafter = SimpleNamespace(config=cfg, fc=SimpleNamespace(weight=torch.zeros(1, dtype=torch.bfloat16)))
    rounds = DraftGraphs(drafter, 4, torch.device("cpu"), replay_eagerly=True)
    rounds.blocks, rounds.absorbs = object(), object()
    class Proposer:               # (the bench keeps the second set by proposer, weakly)
        pass

    proposer = Proposer()
    proposer.drafter, proposer.rounds = drafter, rounds
    gate = SpecGate()
    engine = SimpleNamespace(spec_gate=gate, greedy_chain=True, _proposer=lambda method: proposer)
    own: dict = {}
    with row_gate(engine, "dspark-markov-ref", own):
        ref = proposer.rounds
        assert isinstance(ref, DraftGraphs) and ref is not rounds
        assert (ref.blocks, ref.absorbs, ref.max_batch, ref.replay_eagerly) == (rounds.blocks, rounds.absorbs, 4, True)
        assert os.environ[MARKOV_SLOT_ENV] == "0"
        monkeypatch.setattr("kvspec_kernels.dispatch.use_triton", lambda device: True)   # as on a GPU
        assert not markov_slot_kernels("cuda")
        assert engine.spec_gate is own["dspark-markov-ref"]
    assert proposer.rounds is rounds and engine.spec_gate is gate and MARKOV_SLOT_ENV not in os.environ
    assert markov_slot_kernels("cuda")
    with pytest.raises(RuntimeError), row_gate(engine, "dspark-markov-ref", own):
        assert proposer.rounds is ref                       # kept across cells
        raise RuntimeError("a failed run")
    assert proposer.rounds is rounds and MARKOV_SLOT_ENV not in os.environ
    monkeypatch.setenv(MARKOV_SLOT_ENV, "1")                # a value set before the row comes back as it was
    with row_gate(engine, "dspark-markov-ref", own):
        assert os.environ[MARKOV_SLOT_ENV] == "0"
    assert os.environ[MARKOV_SLOT_ENV] == "1"
    with row_gate(engine, "dspark", own):
        assert proposer.rounds is rounds and os.environ[MARKOV_SLOT_ENV] == "1"


def test_explore_auto_warms_while_the_choosers_cells_of_the_prompts_explore():
    """The auto row's whole-answer warm-ups: run while a cell of the cell's prompt classes at this load still
    explores (here each warm-up finishes one 200-token request of each method), at most ``most`` times, and
    none without a chooser."""
    from types import SimpleNamespace

    from bench.speedup import explore_auto
    from specd.engine.method_choice import MethodChoice

    chooser = MethodChoice(explore=2, explore_tokens=256)
    engine = SimpleNamespace(spec_gate=SimpleNamespace(methods=chooser))
    calls = []

    def warm(tag):
        calls.append(tag)
        for _ in range(2):
            c = chooser.choose((1, 2), 4, ("dspark", "ngram"))
            chooser.observe((1, 2), 4, c.method, 200, 1.0, measured=c.measures)

    assert explore_auto(engine, [(1, 2), (1, 2)], 4, warm) == 2       # 2 requests and 400 tokens a method
    assert calls == ["auto-0", "auto-1"] and chooser.young([(1, 2)], 4) == 0
    assert chooser.young([(1, 2)], 8) == 1 and chooser.young([(1, 2), (3,)], 4) == 1   # another load, class
    assert explore_auto(engine, [(1, 2)], 4, warm) == 0               # explored: nothing to do
    calls.clear()
    assert explore_auto(engine, [(5,)], 4, lambda tag: calls.append(tag), most=3) == 3   # never explored: capped
    assert explore_auto(SimpleNamespace(spec_gate=None), [(5,)], 4, warm) == 0


def test_auto_line_counts_the_steps_drafted_for_measuring_requests():
    """The markdown's auto line adds the steps drafted only for measuring requests (``gate_drafted_by``'s
    "measure"), summed over the cell's runs, and leaves it out where there were none; ``EpochChoice``'s
    unclean requests come from the stats delta like the probes."""
    from bench.speedup import auto_line, auto_split

    assert auto_split({"spec_auto_dspark_requests_total": 3, "spec_auto_ngram_requests_total": 0,
                       "spec_auto_unclean_total": 2, "spec_auto_probes_total": 1}) == {"dspark": 3, "probes": 1,
                                                                                      "unclean": 2}

    runs = [{"auto_methods": {"dspark": 3, "ngram": 1, "measuring": 1}, "gate_drafted_by": {"measure": 40, "class": 2}},
            {"auto_methods": {"dspark": 4, "probes": 1, "measuring": 1}, "gate_drafted_by": {"measure": 2}}]
    assert auto_line(runs) == "dspark 7, ngram 1 (probes 1, measuring 2, measuring steps 42)"
    runs[0]["auto_methods"]["unclean"] = 5            # EpochChoice's requests that taught nothing
    assert auto_line(runs) == "dspark 7, ngram 1 (probes 1, measuring 2, unclean 5, measuring steps 42)"
    assert auto_line([{"auto_methods": {"ngram": 8}, "gate_drafted_by": {"class": 3}}]) == "ngram 8"
    assert auto_line([{"auto_methods": {}}]) == ""


@pytest.mark.slow
def test_the_alternating_row_mixes_every_batch_and_measuring_cost_reads_it(tmp_path, capsys):
    """`auto-alternate`: method auto with a chooser that gives dspark and gated ngram in turn, through a gate
    of its own, so each run's batch holds both methods; ``bench.measuring_cost --row auto-alternate`` then sets
    its runs against the blend of the two rows, and ``bench.mix_rates`` each method's requests against its own
    row. `auto-epoch` (specd/engine/epoch_choice.py) runs beside them through a gate of its own."""
    sampled = _sessions(tmp_path / "stories-t1.jsonl", "sampled", 1.0)
    out = tmp_path / "out"
    rc = bench_main(["speedup", "--model", str(MODEL), "--drafters", f"dspark={DRAFTER}",
                     "--rows", "none,dspark,ngram-gated,auto-alternate,auto-epoch,auto-epoch-hold", "--workloads", str(sampled),
                     "--concurrency", "4", "--requests", "4", "--max-tokens", "10", "--repeats", "2",
                     "--warmup-tokens", "2", "--out", str(out)])
    assert rc == 0
    result = json.loads((out / "speedup.json").read_text())
    cell = result["workloads"]["stories-t1"]["4"]
    for x in cell["rows"]["auto-alternate"]["runs"]:
        assert x["auto_methods"] == {"dspark": 2, "ngram": 2}          # 4 requests a run, in turn
        assert sorted(i for i, _, _, _ in x["requests"]) == [0, 1, 2, 3]
        assert Counter(m for *_, m in x["requests"]) == {"dspark": 2, "ngram": 2}   # each request's own method
    assert cell["auto_extra_warmups"]["auto-alternate"] == 0       # it never explores: no whole-answer warm-ups
    assert cell["auto_extra_warmups"]["auto-epoch"] >= 1             # a new cell explores in epochs before timing
    for x in cell["rows"]["auto-epoch"]["runs"]:
        assert sorted(i for i, _, _, _ in x["requests"]) == [0, 1, 2, 3]
        assert Counter(m for *_, m in x["requests"]) == \
            {m: n for m, n in x["auto_methods"].items() if m in ("dspark", "ngram")}
    assert {s["bucket"] for s in cell["auto_choice_by_row"]["auto-epoch"]} == {4}   # its cells: load 4 only
    assert {s["bucket"] for s in cell["auto_choice_by_row"]["auto-epoch-hold"]} == {4}    # a chooser of its own
    assert "- auto-alternate at concurrency 4, requests by method over the timed runs: dspark 4, ngram 4" \
        in (out / "speedup.md").read_text()
    from bench.measuring_cost import main as cost_main
    assert cost_main([str(out / "speedup.json"), "--row", "auto-alternate"]) == 0
    table = capsys.readouterr().out
    share, mixing = [line for line in table.splitlines() if line.startswith("| c = 2-8 |")]
    assert share.endswith(" (2) | – |")                           # no measuring step: both runs at share ≤ 10%
    assert mixing.startswith("| c = 2-8 | – | ") and mixing.endswith(" (2) |")     # both runs mixed (2 of 4)
    assert cost_main([str(out / "speedup.json"), "--row", "auto"]) == 2                # no auto row in this run
    capsys.readouterr()
    from bench.mix_rates import main as mix_main
    assert mix_main([str(out / "speedup.json"), "--row", "auto-alternate"]) == 0
    rates = [line for line in capsys.readouterr().out.splitlines() if line.startswith("| c = 2-8 |")]
    assert rates[0].startswith("| c = 2-8 | – | ") and rates[0].endswith(" (4) | – |")   # 2 runs x 2 methods, mixed


def test_the_epoch_rows_get_epoch_choosers_of_their_own():
    """`auto-epoch` runs ``EpochChoice`` as measured in session 60 (hold at the chooser's 2% margin) and
    `auto-epoch-hold` one that holds at 10%, each in a gate of its own."""
    from bench.speedup import DEFAULT_ROWS, row_gate
    from specd.engine.epoch_choice import HOLD, EpochChoice
    from specd.engine.spec_gate import SpecGate

    class Engine:
        spec_gate = SpecGate()

    own = {}
    with row_gate(Engine, "auto-epoch", own):
        plain = Engine.spec_gate.methods
    with row_gate(Engine, "auto-epoch-hold", own):
        held = Engine.spec_gate.methods
    assert isinstance(plain, EpochChoice) and isinstance(held, EpochChoice) and plain is not held
    assert (plain.hold, held.hold) == (HOLD, 0.10) and HOLD == plain.margin
    assert not {"auto-epoch", "auto-epoch-hold"} & set(DEFAULT_ROWS)
