"""Which recorded probes of drafting the probe cut (``SpecGate._cuts``) would have ended after their first
sample, and the drafting time their later steps took, from `bench speedup` results.

    python -m bench.probe_cut docs/results/gpu/s32/runC{S,T,U,V,W}/speedup.json.gz [--cut 2.0]

Why: the cut is decided at a probe's second step from the prediction the gate made there, and every
`bench speedup` result keeps each gate cell's first and latest reports with the basis of each decision
(``SpecGate.trace``: predicted drafting tok/s and plain tok/s of the batch). So runs made before the cut
existed say, exactly, which of their recorded probes it would have ended, and what the steps it would have
skipped cost. It reads the records only; nothing is timed here.

What it cannot see: a cell keeps 16 first and 16 latest reports, so probes between them are not in the
records (the count of probes each run's gates started is printed beside the ones found); a report
repeated in several cells' records (a cell's latest reports are written after every cell of the run) is
counted once. Every probe found is judged: the rule that every third probe of a cell runs in full
(``PROBE_FULL_EVERY``) needs the cell's whole sequence of probes, which the records do not keep, so about
a third of the cuts counted here would not happen. A step skipped would have run as a plain step, so its saving is its time over the cell's
plain step (``plain tok/s`` of the batch at that step, for the step's tokens at one per sequence).
"""
from __future__ import annotations

import argparse
from pathlib import Path

from bench.speedup_pool import PoolError, load
from specd.engine.spec_gate import MARGIN, PROBE_CUT

DRAFTED, TOKENS, MS, SEQUENCES, USED, REASON, ACCEPTANCE, PREDICTED, PLAIN = range(9)


def probes(reports: list[list]) -> list[list[list]]:
    """The probes of drafting in one cell's reports, in order: each a run of consecutive drafting reports
    decided as "probe", starting at a sample (a warm-up first step is no sample; the cut waits for one)."""
    out, run = [], []
    for r in reports + [None]:
        if r is not None and r[DRAFTED] and r[REASON] == "probe":
            run.append(r)
            continue
        if run:
            first = next((i for i, x in enumerate(run) if x[USED]), None)
            if first is not None:
                out.append(run[first:])
            run = []
    return out


def verdict(probe: list[list], cut: float, margin: float = MARGIN) -> dict:
    """Would the cut have ended ``probe`` after its first sample? Decided as ``SpecGate._cuts`` decides it,
    on the prediction the gate made at the probe's next step (its report's basis), and what the skipped
    steps cost over plain steps of their batches (ms)."""
    if len(probe) < 2 or probe[1][PREDICTED] is None or not probe[1][PLAIN]:
        return {"steps": len(probe), "judged": False, "cut": False, "saved_ms": 0.0, "ratio": None}
    nxt = probe[1]
    ratio = nxt[PREDICTED] / nxt[PLAIN]
    cuts = not ratio * cut > 1.0 + margin
    saved = 0.0
    if cuts:
        for r in probe[1:]:
            plain_ms = 1e3 * r[SEQUENCES] / r[PLAIN]       # a plain step: one token a sequence at the plain rate
            saved += r[MS] - plain_ms
    return {"steps": len(probe), "judged": True, "cut": cuts, "saved_ms": saved, "ratio": ratio}


def run_probes(result: dict) -> tuple[list[tuple[str, str, list]], int]:
    """(gate, cell key, probe) for every distinct recorded probe in one result, and the probes the engine's
    gate had started by the end of the run (warm-ups included; 0 where no cell recorded its stats)."""
    seen, found = set(), []
    traces = [("engine", result.get("gate_trace", {}))]
    traces += [(f"row {row}", t) for row, t in result.get("gate_trace_by_row", {}).items()]
    started = 0
    for levels in result["workloads"].values():
        for cell in levels.values():
            traces.append(("engine", cell.get("gate_recent", {})))
            traces += [(f"row {row}", t) for row, t in cell.get("gate_recent_by_row", {}).items()]
            started = max(started, cell.get("gate", {}).get("spec_gate_probes_total", 0))
    for gate, trace in traces:
        for key, reports in trace.items():
            for probe in probes(reports):
                ident = (gate, key, tuple(tuple(r) for r in probe))
                if ident not in seen:
                    seen.add(ident)
                    found.append((gate, key, probe))
    return found, started


def bucket(key: str) -> int:
    """The load bucket of a trace key ``<method>_b<bucket>``."""
    return int(key.rsplit("_b", 1)[1])


def report(results: list[tuple[str, dict]], cut: float, listing: bool = False) -> str:
    """Per load bucket: the recorded probes of drafting, how many the cut would have judged (two or more
    steps, the second reported) and ended, their drafting steps before and after, and the ms saved; with
    ``listing``, every probe too."""
    rows = []
    started = 0
    for name, result in results:
        found, n = run_probes(result)
        started += n
        rows += [(name, gate, key, verdict(probe, cut)) for gate, key, probe in found]
    lines = [f"Probes of drafting in the gates' records, judged at their second step as `SpecGate._cuts` "
             f"would with probe_cut = {cut} (margin {MARGIN}); {len(rows)} found, of {started} the engine's "
             "gates started (warm-ups included; each cell records its first and latest 16 reports only).", "",
             "| bucket | probes | judged | cut | drafting steps | kept | ms saved |", "|---|---|---|---|---|---|---|"]
    by: dict[int, list[dict]] = {}
    for _name, _gate, key, v in rows:
        by.setdefault(bucket(key), []).append(v)
    for b in sorted(by):
        vs = by[b]
        lines.append(f"| b{b} | {len(vs)} | {sum(v['judged'] for v in vs)} | {sum(v['cut'] for v in vs)} | "
                     f"{sum(v['steps'] for v in vs)} | {sum(1 if v['cut'] else v['steps'] for v in vs)} | "
                     f"{sum(v['saved_ms'] for v in vs):.1f} |")
    if listing:
        lines += ["", "| result | gate | cell | steps | predicted / plain at step 2 | cut | ms saved |",
                  "|---|---|---|---|---|---|---|"]
        for name, gate, key, v in rows:
            ratio = "-" if v["ratio"] is None else f"{v['ratio']:.2f}"
            lines.append(f"| {name} | {gate} | {key} | {v['steps']} | {ratio} | {'yes' if v['cut'] else 'no'} | "
                         f"{v['saved_ms']:.1f} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.probe_cut", description=__doc__.splitlines()[0])
    p.add_argument("result", type=Path, nargs="+", help="speedup.json or .json.gz files of bench speedup runs")
    p.add_argument("--cut", type=float, default=PROBE_CUT,
                   help=f"the factor to judge by (SpecGate's probe_cut; default {PROBE_CUT})")
    p.add_argument("--list", action="store_true", help="list every probe found, not only the buckets' sums")
    args = p.parse_args(argv)
    if not args.cut >= 1:
        p.error("--cut must be at least 1")
    try:
        print(report([(str(path), load(path)) for path in args.result], args.cut, args.list))
    except PoolError as e:
        p.error(str(e))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
