"""Host time per step of the gate's engine side, plain decoding against dspark with the gate resting.

Why: on the H200 (session 9, run X) scheduled dspark ran at 0.97-0.98x plain decoding at c >= 4 while it
rested in all but a few steps; part of that is the gate's own Python at every step. This probe times the
engine methods the gate runs in (no profiler; stories260K and its committed drafter, 32 requests, c = 32,
greedy), after teaching every load bucket of the gate that drafting loses, so it rests and never probes.
Not a test (pytest does not collect it); run it per tree to compare:

    PYTHONPATH=<tree> python tests/engine/gate_cost_probe.py [--repeats 6]
"""
from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
BASE = ["Once upon a time, there was a", "Tom had a big dog. The dog", "One day, Lily went to the",
        "The sun was hot and", "A little bird sat on", "Max liked to play with", "The cat saw a", "Sue and her mom"]
TIMED = ("_add_drafts", "_observe_gate", "_rest_prompts", "_capture_layers")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--repeats", type=int, default=6)
    p.add_argument("--concurrency", type=int, default=32)
    args = p.parse_args()
    torch.set_num_threads(1)
    from specd.engine.config import EngineConfig
    from specd.engine.engine import SpecEngine
    from specd.engine.request import Request
    from specd.engine.spec_gate import Drafters, SpecGate
    from specd.sampling_params import SamplingParams

    engine = SpecEngine.from_config(EngineConfig(max_num_seqs=args.concurrency, num_local_blocks=2048,
                                                 drafter=ROOT / "models" / "drafters" / "stories260K-dspark",
                                                 speculation="dspark"))
    gate = engine.spec_gate = SpecGate(probe_every=100_000, probe_max=100_000)
    b = 1
    while b <= args.concurrency:          # drafting at a quarter of plain decoding's rate: every cell rests
        for _ in range(12):
            d = gate.should_draft("dspark", b)
            gate.observe("dspark", b, d, b * (2 if d else 1), 0.01 * (8 if d else 1),
                         Drafters(b, 2 * b, 7 * b) if d else None)
        b *= 2
    gate.explores = staticmethod(lambda record: False)
    spent: dict[str, float] = {}
    for name in TIMED:
        inner = getattr(engine, name)

        def timed(*a, _inner=inner, _name=name, **k):
            t0 = time.perf_counter()
            out = _inner(*a, **k)
            spent[_name] = spent.get(_name, 0.0) + time.perf_counter() - t0
            return out
        setattr(engine, name, timed)

    prompts = (BASE * (args.concurrency // len(BASE) + 1))[:args.concurrency]

    def run(spec: str, rep: int) -> dict[str, float]:
        params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
        for i, text in enumerate(prompts):
            engine.add_request(Request(f"{spec}{i}-{rep}", engine.tokenizer.encode(text), params, speculation=spec))
        for _ in range(2):                # admission and prefill
            engine.step()
        spent.clear()
        steps = 0
        while engine.has_work():
            engine.step()
            steps += 1
        return {n: 1e6 * v / steps for n, v in spent.items()}

    runs: dict[str, list] = {"none": [], "dspark": []}
    for rep in range(args.repeats):
        for spec in runs:
            runs[spec].append(run(spec, rep))
    for spec, rs in runs.items():
        parts = {n: round(statistics.median(r.get(n, 0.0) for r in rs), 1) for n in TIMED}
        print(f"{spec}: {parts} µs/step, sum {sum(parts.values()):.1f} (median of {args.repeats})")
    stats = engine.stats()
    print(f"gate rested {stats['spec_paused_steps_total']} steps; verifications {stats.get('spec_verifications_total', 0)}")


if __name__ == "__main__":
    main()
