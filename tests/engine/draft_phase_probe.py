"""A drafting phase's first steps against its later ones on the CPU: does the step that opens a phase (a
probe after a rest) cost more than the phase's other steps, as it did on the H200 at c = 32 (session 40:
10-27 ms against 7-8 ms)? stories260K and its committed drafter behind a gate taught to rest and set to
probe every 16 measured steps, a closed loop of 4 x ``--concurrency`` requests a round with answer lengths
spread over 40 tokens; prints, per round after the first, the engine's ``DRAFT_PHASES`` counters (ms a
step, its schedule and forward parts, tokens a step) beside plain and capture steps. Not a test (pytest
does not collect it):

    python tests/engine/draft_phase_probe.py [--concurrency 16] [--rounds 3]
"""
from __future__ import annotations

from pathlib import Path

from resting_probe_engine import BASE, closed_loop, probe_arguments, taught_to_rest   # this folder

ROOT = Path(__file__).resolve().parents[2]


def main() -> None:
    from specd.engine.config import EngineConfig
    from specd.engine.engine import DRAFT_PHASES, SpecEngine
    from specd.engine.spec_gate import SpecGate

    args = probe_arguments(__doc__, 16, 3, 48, "rounds, the first of them a warm-up")
    c = args.concurrency
    engine = SpecEngine.from_config(EngineConfig(max_num_seqs=c, num_local_blocks=2048, speculation="dspark",
                                                 drafter=ROOT / "models" / "drafters" / "stories260K-dspark"))
    engine.spec_gate = taught_to_rest(SpecGate(probe_every=16, probe_max=16), c)
    prompts = [engine.tokenizer.encode(BASE[i % len(BASE)]) for i in range(4 * c)]
    lengths = [args.max_tokens - 20 + (i * 7) % 41 for i in range(len(prompts))]
    for rnd in range(args.rounds):
        before = engine.stats()
        for _ in closed_loop(engine, prompts, lengths, c, "dspark", f"r{rnd}", 0, {}):
            pass
        d = {k: v - before[k] for k, v in engine.stats().items() if k.startswith("step_")}
        if rnd == 0:
            continue
        for kind in DRAFT_PHASES:
            n = d[f"step_{kind}_steps_total"]
            if n:
                ms = [1e3 * d[f"step_{kind}_{part}seconds_total"] / n
                      for part in ("", "schedule_", "gate_", "propose_", "forward_")]
                print(f"round {rnd} {kind:12s} {n:4d} steps  {ms[0]:6.2f} ms (schedule {ms[1]:.2f}: gate {ms[2]:.2f}, "
                      f"propose {ms[3]:.2f}; forward {ms[4]:.2f})  {d[f'step_{kind}_tokens_total'] / n:5.1f} tokens a step")
        for kind in ("plain", "capture"):
            n = d[f"step_{kind}_steps_total"]
            if n:
                print(f"round {rnd} {kind:12s} {n:4d} steps  {1e3 * d[f'step_{kind}_seconds_total'] / n:6.2f} ms")


if __name__ == "__main__":
    main()
