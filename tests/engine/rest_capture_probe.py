"""Which steps of a resting dspark run still capture target features, against `none` on the same engine.

Why: on the H200 (session 15, run AU, knowledge at c = 32) scheduled dspark rested every step and captured
no prompt, yet its plain steps took 3.19 ms against `none`'s 2.85 (forward +0.28 ms a step). A step that
captures features runs the capture variant of the forward and fuses the features afterwards, so the first
suspect is a resting step that captures anyway. This probe serves the same sampled prompts with `none`
and with dspark behind a gate taught that drafting loses (a slow drafter), and counts the steps with and
without a capture, by kind (pure decode or with prompt chunks), per round. Session 15, CPU: rounds 2-4
capture in 2 of 95 steps (the probe announcements) and run the same step counts as `none`, so the GPU
cost is not explained here. Not a test (pytest does not collect it):

    python tests/engine/rest_capture_probe.py [--rounds 4] [--requests 16]
"""
from __future__ import annotations

import argparse
import collections
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=4, help="rounds of none then dspark (the first explores)")
    p.add_argument("--requests", type=int, default=16, help="requests per row and round (8 run at once)")
    args = p.parse_args()

    sys.path.insert(0, str(ROOT / "tests" / "engine"))
    from test_spec_gate import DRAFTER, PROMPTS, SlowProposer

    from specd.engine.config import EngineConfig
    from specd.engine.engine import SpecEngine
    from specd.engine.request import Request
    from specd.engine.spec_gate import SpecGate
    from specd.sampling_params import SamplingParams

    engine = SpecEngine.from_config(EngineConfig(max_num_seqs=8, num_local_blocks=1024, drafter=DRAFTER,
                                                 speculation="dspark", max_num_batched_tokens=64))
    engine._proposer("dspark")
    engine._proposers["dspark"] = SlowProposer(engine._proposers["dspark"], 0.05)   # drafting loses: rest
    engine.spec_gate = SpecGate(min_samples=3, probe_every=1000, probe_max=1000, probe_steps=1)
    counts: collections.Counter = collections.Counter()
    current = {"row": ""}
    capture_layers = engine._capture_layers

    def counted(batch):
        layers = capture_layers(batch)
        kind = "decode" if engine._decode_step else "prompt"
        counts[(current["row"], kind, "capture" if layers else "no capture")] += 1
        return layers

    engine._capture_layers = counted
    params = SamplingParams(temperature=0.7, top_p=0.9, max_tokens=40, ignore_eos=True, seed=1)
    filler = " ".join(PROMPTS) * 6               # prompts of 40-400 characters: several prompt chunks each
    for rnd in range(args.rounds):
        for spec in ("none", "dspark"):
            current["row"] = f"{spec} round {rnd + 1}"
            for i in range(args.requests):
                ids = engine.tokenizer.encode(PROMPTS[i % len(PROMPTS)] + filler[: 40 + 23 * i])
                engine.add_request(Request(f"{spec}{rnd}-{i}", ids, params, speculation=spec))
            while engine.has_work():
                engine.step()
    for key in sorted(counts):
        print(*key, counts[key], sep="\t")
    stats = engine.stats()
    print({k: v for k, v in stats.items() if "promptless" in k or "paused" in k or k.startswith("spec_gate_drafted")})


if __name__ == "__main__":
    main()
