"""Host time per step of a resting dspark row over `none` in a closed loop, method by method.

Why: ``rest_host_probe.py`` admits every request at once and decodes long answers, so nearly every step is a
leased rest; ``bench speedup`` on the H200 keeps ``concurrency`` requests in flight with 48-token answers, so a
request finishes every few steps, its successor's prompt ends the lease, and the next decode step asks the gate
in full. This probe runs that loop on the CPU machine: stories260K and its committed drafter behind a gate
taught that drafting loses (resting_probe_engine.py), ``4 x concurrency`` requests per round, rows alternated per
round (the first round of each is not counted), the collector's heap frozen after warm-up. It prints the median
µs a step spent in each wrapped engine method, and in ``add_request``, for `none` and `dspark`, and the
difference. The forward dominates a CPU step; compare the host methods. Session 30 (commit 4db38ae) used it:
at c = 16, ``_add_drafts`` over `none` +11.5/+12.0 µs a step before, +8.6/+9.5 after. Not a test (pytest does
not collect it); run it per tree, alternating trees:

    PYTHONPATH=<tree> python tests/engine/closed_loop_probe.py [--concurrency 16] [--rounds 4]
"""
from __future__ import annotations

import collections
import gc
import statistics
import time

from resting_probe_engine import BASE, probe_arguments, resting_engine, time_methods   # this script's folder

METHODS = ("_add_drafts", "_observe_gate", "_rest_prompts", "_capture_layers", "_plan_sampling", "_emit",
           "_update_overhead", "_keep_features", "_sample", "_commit_held")


def main() -> None:
    args = probe_arguments(__doc__, 16, 4, 48, "rounds of both rows, after one warm-up round each")
    from specd.engine.request import Request
    from specd.sampling_params import SamplingParams

    conc = args.concurrency
    engine = resting_engine(conc)
    spent = time_methods(engine, METHODS)
    prompts = [engine.tokenizer.encode(BASE[i % len(BASE)]) for i in range(4 * conc)]

    def run(spec: str, tag: str) -> dict[str, float]:
        params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True)
        queue, inflight, steps, admit = collections.deque(range(len(prompts))), 0, 0, 0.0
        spent.clear()
        while queue or inflight:
            while queue and inflight < conc:
                i = queue.popleft()
                t0 = time.perf_counter()
                engine.add_request(Request(f"{tag}-{i}", list(prompts[i]), params, speculation=spec))
                admit += time.perf_counter() - t0
                inflight += 1
            inflight -= sum(out.finished for out in engine.step())
            steps += 1
        out = {name: 1e6 * s / steps for name, s in spent.items()}
        out["add_request"] = 1e6 * admit / steps
        return out

    run("none", "warm-none")
    run("dspark", "warm-dspark")
    gc.collect()
    gc.freeze()
    got: dict[str, list[dict[str, float]]] = {"none": [], "dspark": []}
    for rnd in range(args.rounds):
        for spec in ("none", "dspark") if rnd % 2 else ("dspark", "none"):
            got[spec].append(run(spec, f"{spec}{rnd}"))
    for name in (*METHODS, "add_request"):
        a = statistics.median(r.get(name, 0.0) for r in got["none"])
        b = statistics.median(r.get(name, 0.0) for r in got["dspark"])
        print(f"{name:17s} none {a:8.1f} µs  dspark {b:8.1f} µs  dspark - none {b - a:+6.1f} µs a step")


if __name__ == "__main__":
    main()
