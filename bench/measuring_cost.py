"""What the auto row's measuring requests cost their batches: each auto run against its main method's row.

    python -m bench.measuring_cost docs/results/gpu/s58/runQA/speedup/speedup.json.gz [more results] \\
        [--share 0.10] [--mixed 0.15] [--rows dspark=dspark,ngram=ngram-gated] [--row auto]

Why: a request the method chooser sends to measure its method may draft at every step (``Choice.drafts``),
and in a batch one drafting request makes the step a drafting step for every request in it. Session 58's runs
(H100, QA-QD) showed the auto row below both single-method rows at c >= 16; this splits that by how many of a
run's steps were drafted for measuring requests alone.

Per load group (c = 1, c = 2-8, c >= 16) it prints, over every timed auto run, the geometric mean of the run's
throughput over the same repeat's run of the row of the method it gave most requests (`dspark` or
`ngram-gated`), apart for runs where such steps were at most ``--share`` of the run's steps and runs where
they were more. Such steps are ``gate_drafted_by["measure"]``; runs recorded before that count existed
(session 58's own) counted them under "class", which is used there (it also holds a recurring class's few
exploring steps: 0 in the single-method rows of those runs).

A second table splits the rest of the gap into the choice and the mixing. Each auto run is set against the blend
of the two rows' runs of the same repeat, weighted by the requests it gave each method (the time the same
requests would have taken, each at its own method's row's rate), and that blend against the faster of the two
rows. auto over the blend is what running the methods side by side in one batch cost; the blend over the faster
row is what the choices cost. Apart for runs whose minority method had more than ``--mixed`` of the requests
(mixed batches) and the others. Session 59 (H100, runs RA-RC): at c >= 16 the runs of one method ran 1.000x
their blend and the mixed ones 0.940x. ``--row auto-alternate`` reads the row whose chooser alternates the
methods request by request (bench/alternating_choice.py): every batch mixed, no choice in it. Reads only what
``bench speedup`` records.
"""
from __future__ import annotations

import argparse
import statistics
import sys
from collections import defaultdict
from pathlib import Path

from bench.speedup_pool import PoolError, load
from bench.auto_replay import pairs

GROUPS = ((1, 1, "c = 1"), (2, 8, "c = 2-8"), (16, 1 << 30, "c >= 16"))


def measure_steps(run: dict) -> int:
    """Steps drafted only for measuring requests; "class" in runs recorded before "measure" existed."""
    reasons = run.get("gate_drafted_by", {})
    return reasons["measure"] if "measure" in reasons else reasons.get("class", 0)


def group_of(level: int) -> str:
    return next(name for low, high, name in GROUPS if low <= level <= high)


def runs_of(results: list[dict], row: str):
    """Every timed run of ``row``: (workload, level, the cell's rows, repeat, run)."""
    for result in results:
        for workload, levels in result["workloads"].items():
            for level, cell in levels.items():
                cell_rows = cell["rows"]
                for rep, run in enumerate(cell_rows.get(row, {}).get("runs", [])):
                    yield workload, level, cell_rows, rep, run


def _rate(cell_rows: dict, ref_row: str, rep: int, workload: str, level: str, what: str) -> float:
    """Throughput of ``ref_row``'s run of repeat ``rep``; PoolError where the cell has no such row."""
    if ref_row not in cell_rows:
        raise PoolError(f"{workload} c = {level}: no {ref_row!r} row to {what}")
    ref = cell_rows[ref_row]["runs"][rep]
    return ref["tokens"] / ref["wall_s"]


def split(results: list[dict], rows: dict[str, str], share: float,
          row: str = "auto") -> dict[tuple[str, bool], list[float]]:
    """(load group, over ``share``) -> each run of ``row`` (method auto): its throughput over its main method's
    row, same repeat."""
    out: dict[tuple[str, bool], list[float]] = defaultdict(list)
    for workload, level, cell_rows, rep, run in runs_of(results, row):
        given = {m: n for m, n in run.get("auto_methods", {}).items() if m in rows}
        if not given or not run.get("steps"):
            continue
        main = max(given, key=lambda m: (given[m], m))
        ref = _rate(cell_rows, rows[main], rep, workload, level, f"compare {row}'s {main} with")
        out[(group_of(int(level)), measure_steps(run) / run["steps"] > share)].append(
            (run["tokens"] / run["wall_s"]) / ref)
    return out


def mixing(results: list[dict], rows: dict[str, str], mixed: float,
           row: str = "auto") -> dict[tuple[str, bool], list[tuple[float, float]]]:
    """(load group, minority share over ``mixed``) -> each run of ``row``'s (throughput over the blend of the rows
    by its requests per method, the blend over the faster row), same repeat. Runs that gave no request to a
    method in ``rows`` are skipped."""
    out: dict[tuple[str, bool], list[tuple[float, float]]] = defaultdict(list)
    for workload, level, cell_rows, rep, run in runs_of(results, row):
        given = {m: n for m, n in run.get("auto_methods", {}).items() if m in rows and n > 0}
        total = sum(given.values())
        if not total:
            continue
        rates = {m: _rate(cell_rows, ref_row, rep, workload, level, f"blend {row}'s {m} with")
                 for m, ref_row in rows.items()}
        blend = 1.0 / sum(n / total / rates[m] for m, n in given.items())
        minority = 1.0 - max(given.values()) / total
        out[(group_of(int(level)), minority > mixed)].append(
            ((run["tokens"] / run["wall_s"]) / blend, blend / max(rates.values())))
    return out


_gm = statistics.geometric_mean


def by_group(groups: dict[tuple, list], header: list[str], cell, note: str, columns=(False, True)) -> str:
    """One markdown table: a line per load group with values, a cell per column (by default: at most the split,
    over it) each ``cell(values)`` or "–"; then ``note``. ``groups`` is keyed (load group, column)."""
    lines = list(header)
    for _low, _high, name in GROUPS:
        cells = [cell(groups[(name, c)]) if groups.get((name, c)) else "–" for c in columns]
        if any(c != "–" for c in cells):
            lines.append(f"| {name} | {' | '.join(cells)} |")
    return "\n".join(lines + ["", note]) + "\n"


def mixing_table(groups: dict[tuple[str, bool], list[tuple[float, float]]], mixed: float) -> str:
    pct = f"{100 * mixed:g}%"
    return by_group(
        groups, [f"| load | one method (minority ≤ {pct}): auto / blend, blend / best (runs) "
                 f"| mixed (minority > {pct}): auto / blend, blend / best (runs) |", "|---|---|---|"],
        lambda v: f"{_gm([a for a, _ in v]):.3f}, {_gm([b for _, b in v]):.3f} ({len(v)})",
        "auto / blend: each auto run's throughput over the same repeat's rows blended by the requests it gave each "
        "method (what running them in one batch cost); blend / best: that blend over the faster row (what the "
        "choices cost). Geometric means.")


def table(groups: dict[tuple[str, bool], list[float]], share: float) -> str:
    pct = f"{100 * share:g}%"
    return by_group(
        groups, [f"| load | share ≤ {pct}: ratio (runs) | share > {pct}: ratio (runs) |", "|---|---|---|"],
        lambda v: f"{_gm(v):.3f} ({len(v)})",
        "Each auto run's throughput over the same repeat's run of its main method's row (geometric mean), by the "
        "share of its steps drafted for measuring requests alone.")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.measuring_cost", description=__doc__.split("\n\n")[0])
    p.add_argument("result", type=Path, nargs="+",
                   help="speedup.json or .json.gz of bench speedup runs with an auto row")
    p.add_argument("--share", type=float, default=0.10, help="the split: share of a run's steps (default 0.10)")
    p.add_argument("--mixed", type=float, default=0.15,
                   help="the second table's split: the minority method's share of a run's requests (default 0.15)")
    p.add_argument("--rows", type=pairs, default=pairs("dspark=dspark,ngram=ngram-gated"),
                   help="method=row each auto run is compared with, by the method it gave most requests")
    p.add_argument("--row", default="auto", help="the row of method auto to read (default auto; auto-alternate: "
                   "the row whose batches are always mixed)")
    args = p.parse_args(argv)
    try:
        results = [load(path) for path in args.result]
        groups = split(results, args.rows, args.share, args.row)
        blends = mixing(results, args.rows, args.mixed, args.row)
    except PoolError as exc:
        print(f"measuring_cost: {exc}", file=sys.stderr)
        return 2
    if not groups:
        print(f"measuring_cost: no {args.row} run in these results", file=sys.stderr)
        return 2
    sys.stdout.write(table(groups, args.share) + "\n" + mixing_table(blends, args.mixed))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
