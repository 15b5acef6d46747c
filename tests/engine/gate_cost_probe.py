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

import torch
from resting_probe_engine import BASE, TIMED, one_batch, resting_engine, time_methods   # this script's folder


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--repeats", type=int, default=6)
    p.add_argument("--concurrency", type=int, default=32)
    args = p.parse_args()
    torch.set_num_threads(1)

    engine = resting_engine(args.concurrency)
    spent = time_methods(engine, TIMED)

    prompts = (BASE * (args.concurrency // len(BASE) + 1))[:args.concurrency]

    def run(spec: str, rep: int) -> dict[str, float]:
        steps = one_batch(engine, spent, prompts, spec, f"{spec}-{rep}-", max_tokens=40)
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
