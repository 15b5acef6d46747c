"""Host time per step of a resting dspark row over `none`, by the engine's own phase counters, in one engine.

Why: on the H200 (session 18, runs BH and BI) scheduled dspark ran 0.97-0.99x `none` in every cell where the
gate rests, and its phase times put ~38 µs a step of host time over `none`'s there (docs/results/speedup.md,
"Session 26"). This probe measures the same difference on the CPU machine: stories260K and its committed
drafter behind a gate taught that drafting loses (resting_probe_engine.py), the same prompts served greedily as
`none` and as `dspark`, alternated per round (the first round is not counted), the collector's heap frozen
after warm-up as `specd` freezes it. It prints the median µs a step of each phase (the engine's
``*_seconds_total`` over its steps), the rest of the step (wall time minus the phases), and the difference.
The forward dominates a CPU step and varies from run to run; compare the host phases, not the step. Not a
test (pytest does not collect it); run it per tree, alternating trees:

    PYTHONPATH=<tree> python tests/engine/rest_host_probe.py [--concurrency 4] [--rounds 7]
"""
from __future__ import annotations

import gc
import statistics
import time

from resting_probe_engine import BASE, probe_arguments, resting_engine   # this script's folder

PHASES = ("schedule", "forward", "output", "commit")


def main() -> None:
    args = probe_arguments(__doc__, 4, 7, 120, "rounds of both rows (the first is not counted)")
    from specd.engine.request import Request
    from specd.sampling_params import SamplingParams

    conc = args.concurrency
    engine = resting_engine(conc)
    prompts = (BASE * (conc // len(BASE) + 1))[:conc]

    def run(spec: str, rnd: int) -> dict[str, float]:
        params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True)
        for i, text in enumerate(prompts):
            engine.add_request(Request(f"{spec}{i}-{rnd}", engine.tokenizer.encode(text), params, speculation=spec))
        for _ in range(2):                   # admission and prefill
            engine.step()
        before, t0, steps = engine.stats(), time.perf_counter(), 0
        while engine.has_work():
            engine.step()
            steps += 1
        wall, after = time.perf_counter() - t0, engine.stats()
        done = after["steps_total"] - before["steps_total"]
        out = {ph: 1e6 * (after[f"{ph}_seconds_total"] - before[f"{ph}_seconds_total"]) / done for ph in PHASES}
        out["step"] = 1e6 * wall / steps
        out["rest of step"] = out["step"] - sum(out[ph] for ph in PHASES)
        return out

    run("none", -1)
    run("dspark", -1)
    gc.collect()
    gc.freeze()
    got: dict[str, list[dict[str, float]]] = {"none": [], "dspark": []}
    before = engine.stats()
    for rnd in range(args.rounds):
        for spec in ("none", "dspark") if rnd % 2 else ("dspark", "none"):
            r = run(spec, rnd)
            if rnd:
                got[spec].append(r)
    after = engine.stats()
    for name in (*PHASES, "rest of step", "step"):
        a = statistics.median(r[name] for r in got["none"])
        b = statistics.median(r[name] for r in got["dspark"])
        print(f"{name:13s} none {a:9.1f} µs  dspark {b:9.1f} µs  dspark - none {b - a:+7.1f} µs")
    keys = ("spec_paused_steps_total", "spec_rest_again_steps_total", "spec_rest_leased_steps_total",
            "spec_verifications_total")
    counts = {k: after.get(k, 0) - before.get(k, 0) for k in keys}
    print("counts over the measured rounds:", counts)


if __name__ == "__main__":
    main()
