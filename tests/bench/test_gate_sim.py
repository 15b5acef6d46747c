"""bench.gate_sim: `bench speedup` on a modeled clock, where each engine step costs what the cost model says."""
from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest

from bench.gate_sim import ModeledClock, StepCosts, main
from bench.workloads.format import Message, Sampling, Session, Turn, write_sessions

REPO = Path(__file__).resolve().parents[2]
MODEL = REPO / "models" / "stories260K.gguf"
DRAFTER = REPO / "models" / "drafters" / "stories260K-dspark"


def seq(num_tokens: int = 1, decodes: bool = True, num_draft: int = 0):
    return SimpleNamespace(num_tokens=num_tokens, decodes=decodes, num_draft=num_draft)


def test_step_costs_price_decoders_prompt_chunks_drafts_and_captures():
    c = StepCosts()
    assert c.forward_ms([seq()] * 32, False) == pytest.approx(1.75 + 0.036 * 32)           # 2.9 ms: a plain step
    with_prompt = [seq()] * 3 + [seq(num_tokens=200, decodes=False)]
    assert c.forward_ms(with_prompt, False) == pytest.approx(1.75 + 0.036 * 4 + 4.0 + 0.0005 * 200)
    drafted = [seq(num_draft=7)] * 32
    assert c.forward_ms(drafted, False) == pytest.approx(1.75 + 0.036 * 32 + 0.015 * 224)
    assert c.forward_ms(drafted, True) == pytest.approx(1.3 * c.forward_ms(drafted, False))
    assert c.draft_ms(32) == pytest.approx(1.0 + 0.15 * 32) and c.draft_ms(0) == 0.0
    assert c.absorb_ms(100) == pytest.approx(0.3 + 0.2) and c.absorb_ms(0) == 0.0
    # the SPS profile's verify pass: 64 tokens of 8 a sequence are 8 decoders verifying 56 drafts
    assert c.verify_ms(64, 7) == pytest.approx(1.75 + 0.036 * 8 + 0.015 * 56)


def test_the_modeled_clock_moves_by_host_ticks_and_modeled_work_only():
    clock = ModeledClock(host_s=1e-6)
    a = clock.perf_counter()
    clock.advance(2.5)
    assert clock.perf_counter() - a == pytest.approx(2.5e-3 + 1e-6)


@pytest.mark.skipif(not MODEL.exists(), reason="stories260K not present")
def test_a_run_on_the_modeled_clock_is_deterministic_and_priced_by_the_model(tmp_path):
    """Plain steps of two sequences last the model's 1.822 ms (plus host ticks of 0.1 µs), the rows' walls are
    the same to the tick, and the result says its clock was a model."""
    greedy = tmp_path / "stories-greedy.jsonl"
    write_sessions(greedy, [Session(id=f"g{i}", workload="greedy", split="eval", arrival_s=0.0,
                                    turns=[Turn(messages=[Message(role="user", content=t)], max_tokens=64)],
                                    sampling=Sampling(temperature=0.0))
                            for i, t in enumerate(["Once upon a time, there was a", "Tom had a big dog. The dog"])])
    out = tmp_path / "out"
    assert main(["--model", str(MODEL), "--drafters", f"dspark={DRAFTER}", "--workloads", str(greedy),
                 "--concurrency", "2", "--rows", "none,none-aa,dspark", "--requests", "4", "--max-tokens", "12",
                 "--repeats", "2", "--warmup-tokens", "2", "--out", str(out)]) == 0
    result = json.loads((out / "speedup.json").read_text())
    assert result["modeled_costs_ms"]["decode_base"] == 1.75 and result["command"].startswith("python -m bench.gate_sim")
    assert "MODELED CLOCK" in (out / "speedup.md").read_text()
    rows = result["workloads"]["stories-greedy"]["2"]["rows"]
    none = [r["wall_s"] for r in rows["none"]["runs"] + rows["none-aa"]["runs"]]
    assert max(none) - min(none) < 1e-4                       # host ticks only: ~0.1 µs a timer reading
    plain = rows["none"]["runs"][0]["step_kinds"]["plain"]
    assert plain["ms"] / plain["steps"] == pytest.approx(1.75 + 0.036 * 2, abs=0.01)
