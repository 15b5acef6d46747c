"""Host time per step of a resting dspark row over `none` in a closed loop, method by method, decode steps
apart from prompt steps.

Why: ``rest_host_probe.py`` admits every request at once and decodes long answers, so nearly every step is a
leased rest; ``bench speedup`` on the H200 keeps ``concurrency`` requests in flight with answers of different
lengths, so a request finishes every few steps, its successor's prompt ends the lease, and the next decode step
asks the gate in full. This probe runs that loop on the CPU machine: stories260K and its committed drafter behind
a gate taught that drafting loses (resting_probe_engine.py), ``4 x concurrency`` requests per round, rows
alternated per round (the first round of each is not counted), the collector's heap frozen after warm-up. It
prints the median µs each wrapped engine method spent per decode step and per prompt step, and ``add_request``
per request, for `none` and `dspark`, and the difference. The forward dominates a CPU step; compare the host
methods.

Answer lengths are spread over ``--stagger`` tokens around ``--max-tokens`` (session 31): with equal lengths
every request of a wave finished in the same step, so a round at c = 32 had 4 prompt steps of ~190, where the
H200 runs had 47-80 of ~200 (CR, coding and support), and the prompt steps' gate cost (~50 µs each over
`none`, the largest item left) did not show. ``--stagger 0`` runs the equal lengths of session 30 (commit 4db38ae:
at c = 16, ``_add_drafts`` over `none` +11.5/+12.0 µs a step before, +8.6/+9.5 after). Not a test (pytest does
not collect it); run it per tree, alternating trees:

    PYTHONPATH=<tree> python tests/engine/closed_loop_probe.py [--concurrency 16] [--rounds 4] [--stagger 40]
                                                               [--queued 4]

``--queued N`` keeps N more requests waiting in the engine's queue, as an open loop near saturation does: a
closed loop never queues, and until session 33 a queued gated request kept every rest lease from becoming
a span (``GateSteps._may_span``).
"""
from __future__ import annotations

import gc
import statistics

from resting_probe_engine import BASE, closed_loop, probe_arguments, resting_engine, time_methods   # this folder

METHODS = ("_add_drafts", "_observe_gate", "_rest_prompts", "_capture_layers", "_plan_sampling", "_emit",
           "_update_overhead", "_keep_features", "_sample", "_commit_held")


def main() -> None:
    args = probe_arguments(__doc__, 16, 4, 48, "rounds of both rows, after one warm-up round each",
                           stagger=(40, "answer lengths spread over this many tokens around --max-tokens (0: all "
                                        "equal, the probe before session 31)"),
                           queued=(0, "requests kept waiting in the engine's queue beyond --concurrency (its "
                                      "max_num_seqs), as arrivals that outpace it do (session 33)"))
    conc = args.concurrency
    engine = resting_engine(conc)
    spent = time_methods(engine, METHODS, kind=lambda: "decode" if engine._decode_step else "prompt")
    prompts = [engine.tokenizer.encode(BASE[i % len(BASE)]) for i in range(4 * conc)]
    lengths = [max(1, args.max_tokens - args.stagger // 2 + (i * 7) % (args.stagger + 1)) for i in range(len(prompts))]

    def run(spec: str, tag: str) -> dict:
        before, admitted = dict(engine._counters), {}
        spent.clear()
        for _ in closed_loop(engine, prompts, lengths, conc, spec, tag, args.queued, admitted):
            pass
        steps = {kind: engine._counters[f"step_{kind}_steps_total"] - before.get(f"step_{kind}_steps_total", 0)
                 for kind in ("plain", "prompt")}
        out = {(name, kind): 1e6 * s / max(1, steps["plain" if kind == "decode" else "prompt"])
               for (name, kind), s in spent.items()}
        out["steps"] = steps
        out["add_request"] = 1e6 * admitted.get("s", 0.0) / len(prompts)
        return out

    run("none", "warm-none")
    run("dspark", "warm-dspark")
    gc.collect()
    gc.freeze()
    got: dict[str, list[dict]] = {"none": [], "dspark": []}
    for rnd in range(args.rounds):
        for spec in ("none", "dspark") if rnd % 2 else ("dspark", "none"):
            got[spec].append(run(spec, f"{spec}{rnd}"))
    print(f"steps a round (none, then dspark): {got['none'][0]['steps']}, {got['dspark'][0]['steps']}")
    for kind in ("decode", "prompt"):
        for name in METHODS:
            a = statistics.median(r.get((name, kind), 0.0) for r in got["none"])
            b = statistics.median(r.get((name, kind), 0.0) for r in got["dspark"])
            print(f"{name:17s} {kind:6s} step: none {a:8.1f} µs  dspark {b:8.1f} µs  dspark - none {b - a:+6.1f} µs")
    a = statistics.median(r["add_request"] for r in got["none"])
    b = statistics.median(r["add_request"] for r in got["dspark"])
    print(f"{'add_request':17s} a request:   none {a:8.1f} µs  dspark {b:8.1f} µs  dspark - none {b - a:+6.1f} µs")


if __name__ == "__main__":
    main()
