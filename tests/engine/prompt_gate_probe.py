"""Host time of the gate's engine side in steps with prompt chunks and in pure decode steps, `none` against
dspark behind a resting gate, in a closed loop where requests finish at different steps (so prompts arrive
beside decoders, as in ``bench speedup``).

Why: on the H200 (session 17, run BE) scheduled dspark's prompt steps at c = 32 took 0.26-0.39 ms more than
`none`'s in resting cells (coding 9.08 against 8.82 ms, support 8.14 against 7.75), ~1% of those runs; the
pure-decode probe (gate_cost_probe.py) does not see prompt steps. Not a test (pytest does not collect it);
run it per tree to compare:

    PYTHONPATH=<tree> python tests/engine/prompt_gate_probe.py [--concurrency 32] [--repeats 5]
"""
from __future__ import annotations

import argparse
import statistics

import torch
from resting_probe_engine import BASE, TIMED, resting_engine, time_methods   # this script's folder


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--concurrency", type=int, default=32)
    p.add_argument("--repeats", type=int, default=5, help="rounds of none then dspark (the first is not counted)")
    p.add_argument("--parts", action="store_true", help="also the time of each timed function")
    args = p.parse_args()
    torch.set_num_threads(1)
    from specd.engine.request import Request
    from specd.sampling_params import SamplingParams

    conc = args.concurrency
    engine = resting_engine(conc, num_local_blocks=4096)
    spent = time_methods(engine, TIMED)

    def run(spec: str, rep: int) -> tuple[dict[str, float], dict[str, int]]:
        queue = [(i, BASE[i % len(BASE)]) for i in range(4 * conc)]
        inflight, per = 0, {"prompt": [0, 0.0], "decode": [0, 0.0]}
        parts = {(kind, name): 0.0 for kind in per for name in TIMED}
        while queue or engine.has_work():
            while queue and inflight < conc:
                i, text = queue.pop(0)      # answers of 8-47 tokens: requests finish apart, prompts arrive apart
                params = SamplingParams(temperature=0.0, max_tokens=8 + (i * 7) % 40, ignore_eos=True)
                engine.add_request(Request(f"{spec}{i}-{rep}", engine.tokenizer.encode(text), params,
                                           speculation=spec))
                inflight += 1
            spent.clear()
            outs = engine.step()
            inflight -= sum(1 for o in outs if o.finished)
            kind = "decode" if engine._decode_step else "prompt"
            per[kind][0] += 1
            per[kind][1] += sum(spent.values())
            for name, sec in spent.items():
                parts[(kind, name)] += sec
        out = {k: 1e6 * v[1] / max(v[0], 1) for k, v in per.items()}
        out.update({f"{k}{n}": 1e6 * sec / max(per[k][0], 1) for (k, n), sec in parts.items()})
        return out, {k: v[0] for k, v in per.items()}

    runs: dict[str, list] = {"none": [], "dspark": []}
    for rep in range(args.repeats):
        for spec in runs:
            runs[spec].append(run(spec, rep))
    for spec, rs in runs.items():
        med = {k: round(statistics.median(r[0][k] for r in rs[1:]), 1) for k in ("prompt", "decode")}
        print(f"{spec}: steps {rs[-1][1]}, gate-side µs per step {med} (median of {len(rs) - 1})")
        if args.parts:
            print("  by function:", {k: round(statistics.median(r[0][k] for r in rs[1:]), 1) for k in rs[0][0]
                                     if k not in ("prompt", "decode")})


if __name__ == "__main__":
    main()
