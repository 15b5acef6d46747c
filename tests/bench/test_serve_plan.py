"""``bench serve-plan`` on the CPU with stories260K: the tiny plan end to end (session files built, one
persistent group, every part's JSON, report.md and the asked-for PNG in OUT, consistent reports), a
budget that runs out mid-plan, and the plan file's guards."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from bench.__main__ import main as bench_main
from bench.report import check_report
from bench.serve_plan import PlanError, load_plan

REPO = Path(__file__).resolve().parents[2]
MODEL = REPO / "models" / "stories260K.gguf"


@pytest.fixture(scope="module")
def sessions(tmp_path_factory):
    folder = tmp_path_factory.mktemp("sessions")
    assert bench_main(["serve-plan", "--plan", "cpu-tiny", "--build", "--sessions", str(folder)]) == 0
    return folder


def _run(sessions: Path, out: Path, budget: float) -> int:
    return bench_main(["serve-plan", "--plan", "cpu-tiny", "--model", str(MODEL), "--device", "cpu",
                       "--sessions", str(sessions), "--out", str(out), "--work", str(out.parent / "work"),
                       "--budget-s", str(budget), "--no-progress"])


@pytest.mark.slow
def test_tiny_plan_end_to_end(sessions, tmp_path):
    assert {p.name for p in sessions.iterdir()} == {"coding.jsonl", "unique.jsonl", "trace.jsonl"}
    out = tmp_path / "out"
    assert _run(sessions, out, 600) == 0
    files = sorted(p.name for p in out.iterdir())
    assert files == ["coding-ttft.png", "issue4.json", "mooncake.json", "report.md", "unique.json"]
    assert all(p.is_file() and 0 < p.stat().st_size < 16e6 for p in out.iterdir())
    steps = {}
    for part in ("issue4", "unique", "mooncake"):
        steps.update(json.loads((out / f"{part}.json").read_text())["steps"])
    for name, step in steps.items():
        assert step["status"] == "done", name
        assert check_report(step["results"]) == [], name
        assert step["requests"] and all("text" not in r and r["error"] is None for r in step["requests"])
    coding = steps["coding"]["results"]["configs"]
    assert set(coding) == {"standard", "prefix-lru", "ours"} and set(coding["ours"]) == {"1", "2"}
    assert coding["standard"]["2"]["cached_prompt_tokens"] == 0 < coding["ours"]["2"]["cached_prompt_tokens"]
    assert all(steps["unique"]["results"]["configs"][c]["2"]["cached_prompt_tokens"] == 0 for c in ("standard", "ours"))
    assert steps["trace"]["results"]["configs"]["ours"]["2"]["cached_prompt_tokens"] > 0  # shared hash ids hit
    report = (out / "report.md").read_text()
    assert "| coding | issue4 | done | ok |" in report and "# Step `trace`" in report
    assert "## Where the time went" in report  # the daemons' stats reach the plan's report and its JSON
    assert coding["ours"]["2"]["stats"]["kvd"]["counters"]["lookups"] > 0
    assert coding["standard"]["2"]["stats"]["specd"]["counters"]["steps_total"] > 0
    assert "kvd" not in coding["standard"]["2"]["stats"]


@pytest.mark.slow
def test_a_spent_budget_stops_cleanly_and_writes_what_it_has(sessions, tmp_path):
    out = tmp_path / "out"
    assert _run(sessions, out, 1) == 1  # the stacks take longer than 1 s to start: every step is skipped
    report = (out / "report.md").read_text()
    assert report.count("skipped: budget spent") == 3
    assert json.loads((out / "issue4.json").read_text())["steps"]["coding"]["results"] is None


def test_plans_are_guarded(tmp_path):
    plan = load_plan("cpu-tiny")
    step = plan["groups"][0]["steps"][0]
    plan["groups"][0]["steps"] += [{**step, "name": f"s{i}", "part": f"p{i}", "plot": "ttft"} for i in range(3)]
    path = tmp_path / "big.json"
    path.write_text(json.dumps(plan))
    with pytest.raises(PlanError, match="at most 8"):
        load_plan(str(path))
    assert load_plan("gpu-all")["name"] == "gpu-all"


def test_every_bundled_plan_loads():
    """The GPU session script names these plans; a broken one would only fail on the device."""
    names = sorted(p.stem for p in (Path(__file__).resolve().parents[2] / "bench" / "plans").glob("*.json"))
    assert {"gpu-all", "gpu-kv", "gpu-creative", "gpu-agentic", "gpu-agentic-idle", "gpu-zero-hit", "gpu-mooncake", "cpu-tiny"} <= set(names)
    for name in names:
        assert load_plan(name)["name"] == name
