"""The steps of a resting dspark row that fall outside a rest span, one by one, with the gate methods each
took and their µs: where the rested path still asks the gate in full.

Why: on the H200 (session 36, runs DC and DD) the resting row's span steps cost about what `none`'s steps
do, but its runs at c = 16 still spent +20-50 µs a step scheduling over `none` on knowledge (112 steps a
run, 83 of them in spans). The closed-loop probe (closed_loop_probe.py) gives medians per step kind; this
lists the steps that left the span instead: each round's first prompt and decode steps (a full walk, then
a second step before the span begins), each lease's renewal, and the drain, where every change of load
bucket (16 → 8 → 4 → 2 → 1 sequences) folds the lease and walks the batch again. Same engine as the other
probes (resting_probe_engine.py: stories260K and its committed drafter behind a gate taught to rest), a
closed loop of ``4 x concurrency`` requests a round with answers of 28-68 tokens and prompts of several
chunks; the first round of each row is a warm-up. Not a test (pytest does not collect it):

    PYTHONPATH=<tree> python tests/engine/span_gap_probe.py [--concurrency 16] [--rounds 2]
"""
from __future__ import annotations

import collections
import gc

from resting_probe_engine import BASE, closed_loop, probe_arguments, resting_engine, time_methods   # this folder

GATE = ("_add_drafts", "_rest_prompts", "_observe_gate", "_gate_group", "_rests_again", "_renews_span",
        "_rests_whole_batch", "_carries", "_fold")
CRITICAL = ("_add_drafts", "_rest_prompts", "_observe_gate")     # the outer calls: the others run inside them


def main() -> None:
    args = probe_arguments(__doc__, 16, 2, 48, "rounds of both rows, after one warm-up round each")
    conc = args.concurrency
    engine = resting_engine(conc)
    spent = time_methods(engine, GATE)
    prompts = [engine.tokenizer.encode(" ".join([BASE[i % len(BASE)]] * 6)) for i in range(4 * conc)]
    lengths = [28 + (i * 7) % 41 for i in range(len(prompts))]

    def run(spec: str, tag: str) -> list[dict]:
        steps, spans = [], engine._counters["spec_rest_span_steps_total"]
        spent.clear()
        for _ in closed_loop(engine, prompts, lengths, conc, spec, tag):   # after each step
            before, spans = spans, engine._counters["spec_rest_span_steps_total"]
            steps.append({"span": spans > before, "decode": engine._decode_step,
                          "batch": len(engine.scheduler.running), "us": {k: 1e6 * v for k, v in spent.items()}})
            spent.clear()            # before the next step's admissions, which call none of GATE
        engine.step()                # idle, as between the bench's runs
        return steps

    run("none", "warm-none")
    run("dspark", "warm-dspark")
    gc.collect()
    gc.freeze()
    for rnd in range(args.rounds):
        for spec in ("none", "dspark"):
            steps = run(spec, f"{spec}{rnd}")
            kinds: dict[tuple[str, str], list[float]] = collections.defaultdict(list)
            for s in steps:
                kind = ("span" if s["span"] else "asked", "decode" if s["decode"] else "prompt")
                kinds[kind].append(sum(s["us"].get(k, 0.0) for k in CRITICAL))
            summary = ", ".join(f"{a} {b} steps: {len(v)}, {sum(v) / len(v):.1f} µs each, {sum(v):.0f} µs"
                                for (a, b), v in sorted(kinds.items()))
            print(f"round {rnd} {spec}: {len(steps)} steps; gate time ({' + '.join(CRITICAL)}): {summary}")
            if spec == "dspark" and rnd == args.rounds - 1:
                print("dspark steps outside a span (index, decode, batch after the step, µs per gate method):")
                for i, s in enumerate(steps):
                    if not s["span"]:
                        print(f"  {i:4d} {'decode' if s['decode'] else 'prompt'} {s['batch']:3d} "
                              + " ".join(f"{k}={v:.0f}" for k, v in s["us"].items()))


if __name__ == "__main__":
    main()
