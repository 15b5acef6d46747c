"""One gate cell's recorded reports from `bench speedup` results, as a table, with the drafting step time its
predictions imply.

    python -m bench.gate_trace docs/results/gpu/s45/runDV/speedup/speedup.json.gz --cell dspark_b4
    python -m bench.gate_trace RESULT --cell dspark_b4 --at extraction.eval:4 [--row ngram-gated]

Why: every `bench speedup` result keeps each gate cell's first reports (``gate_trace``, the run's whole
start) and, after each (workload, concurrency) cell, its latest ones (``gate_recent``; a row behind a gate of
its own: ``gate_recent_by_row``), each with the basis of the decision (``SpecGate.trace``). Reading them
meant a script each time. The implied step time is what the cell's prediction charges a drafting step:
predicted tokens a sequence × sequences / predicted drafting tok/s. H100, session 45 (run DV): on extraction
at c = 4 the b4 cell predicted 3.10 tokens a sequence, as `dspark-g7` measured, but priced a drafting step at
6.5 ms where `dspark-g7`'s took 3.97, so it rested where fixed γ = 7 ran 1.54x `none`; its first reports
are a probe's 10.3 and 6.0 ms steps. It reads the records only; nothing is timed here.
"""
from __future__ import annotations

import argparse
from pathlib import Path

from bench.probe_cut import ACCEPTANCE, DRAFTED, MS, PLAIN, PREDICTED, REASON, SEQUENCES, TOKENS, USED
from bench.speedup_pool import PoolError, load


def reports(result: dict, cell: str, at: str | None = None, row: str | None = None) -> list[list]:
    """``cell``'s reports (e.g. ``dspark_b4``): the run's first ones, or with ``at`` ("workload:concurrency")
    the latest ones after that cell; ``row``: that row's own gate (``gate_recent_by_row``), which has no
    first reports in the result."""
    if at is None:
        if row is not None:
            raise PoolError("--row needs --at: a row's own gate keeps its latest reports per cell only")
        traces = result.get("gate_trace")
        where = "the run's first reports (gate_trace)"
    else:
        workload, _, level = at.rpartition(":")
        got = result.get("workloads", {}).get(workload, {}).get(level)
        if got is None:
            raise PoolError(f"no cell {at!r}: workload:concurrency, e.g. extraction.eval:4")
        traces = got.get("gate_recent") if row is None else got.get("gate_recent_by_row", {}).get(row)
        where = f"{at}'s latest reports" + (f" of row {row}" if row else "")
    if not traces:
        raise PoolError(f"no gate reports in {where}")
    if cell not in traces:
        raise PoolError(f"no cell {cell!r} in {where}; cells: {', '.join(sorted(traces))}")
    return traces[cell]


def implied_step_ms(report: list) -> float | None:
    """The drafting step time the report's prediction charges: predicted tokens a sequence × sequences /
    predicted drafting tok/s, in ms; None while the cell explores (no prediction)."""
    acceptance, predicted = report[ACCEPTANCE], report[PREDICTED]
    if acceptance is None or not predicted:
        return None
    return 1e3 * acceptance * report[SEQUENCES] / predicted


def table(rows: list[list]) -> str:
    lines = ["| # | drafted | tokens | ms | sequences | sample | reason | predicted tokens a sequence | "
             "predicted drafting tok/s | plain tok/s | implied drafting step ms |", "|---" * 11 + "|"]
    for i, r in enumerate(rows):
        implied = implied_step_ms(r)
        cols = [i, "yes" if r[DRAFTED] else "no", r[TOKENS], f"{r[MS]:.2f}", r[SEQUENCES],
                "yes" if r[USED] else "warm-up", r[REASON] or "-",
                "-" if r[ACCEPTANCE] is None else f"{r[ACCEPTANCE]:.2f}",
                "-" if r[PREDICTED] is None else f"{r[PREDICTED]:.0f}",
                "-" if r[PLAIN] is None else f"{r[PLAIN]:.0f}", "-" if implied is None else f"{implied:.2f}"]
        lines.append("| " + " | ".join(str(c) for c in cols) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.gate_trace", description=__doc__.split("\n\n")[0])
    p.add_argument("result", type=Path, help="a speedup.json or .json.gz of bench speedup")
    p.add_argument("--cell", required=True, help="the gate cell, <gate key>_b<bucket>, e.g. dspark_b4")
    p.add_argument("--at", default=None, help="workload:concurrency, e.g. extraction.eval:4: that cell's latest "
                                              "reports (default: the run's first reports)")
    p.add_argument("--row", default=None, help="with --at: the reports of this row's own gate (rows such as "
                                               "ngram-gated or dspark-probe-uncut run behind one)")
    args = p.parse_args(argv)
    try:
        print(table(reports(load(args.result), args.cell, args.at, args.row)))
    except PoolError as e:
        p.error(str(e))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
