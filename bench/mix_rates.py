"""How fast a method's requests decode in an auto row's mixed batches, against the same method's own row.

    python -m bench.mix_rates docs/results/gpu/s59/runRB/speedup/speedup.json.gz [more results] \\
        [--rows dspark=dspark,ngram=ngram-gated] [--row auto] [--mixed 0.15]

Why: method `auto` (specd/engine/method_choice.py) rates each candidate by its requests' decode rate, and at
c > 1 those requests run in batches that hold the other method's requests too. Every request of a batch
shares its step time, so a request's rate there is its tokens per step over a step shaped by the whole batch,
not its rate in a batch of its own method. If the minority method's requests decode slower than in their own
row, the chooser sees the method in the lead as faster than it is and keeps it: session 59's creative c = 16
cell (H100, run RB) gave dspark 63 of 64 requests in every repeat, where the `ngram-gated` row ran 1.53x
`none` per user and `dspark` 1.03x.

Two tables:
- **Request rates** (runs from session 60 on, which record each request's method in ``requests``): per load
  group and by the method's share of the run's requests (alone-ish, mixed, minority), the geometric mean over
  (cell, repeat, method) of the p50 per-request rate of that method's requests in the auto run over the p50 in
  the same repeat's run of the method's own row. No selection in it: every request counts, whichever method it
  was given, and with ``--row auto-alternate`` (bench/alternating_choice.py) every batch is half each method.
- **The chooser's view** (any run with ``auto_choice_by_row``): each cell's candidates at the end of the cell,
  the decayed rate the chooser holds (``MethodChoice.snapshot``) over the method's own row's per-user p50,
  apart for the cell's winner and its loser. It has selection in it (a loser is a loser because it measured
  low; c = 1, where nothing mixes, shows how much) and the decay weights the cell's last requests, so read it
  against c = 1. A prompt class is matched to the first workload whose cell shows it (the rows' chooser
  outlives the cells, and ``bench speedup`` runs workload after workload).
"""
from __future__ import annotations

import argparse
import statistics
import sys
from collections import Counter, defaultdict
from pathlib import Path

from bench.auto_replay import pairs
from bench.measuring_cost import by_group, group_of, runs_of
from bench.speedup_pool import PoolError, load

SHARES = ("alone-ish", "mixed", "minority")


def share_of(n: int, total: int, mixed: float) -> str:
    """A method's place in a run by its share of the requests: above 1 - ``mixed``, below ``mixed``, between."""
    part = n / total
    return "alone-ish" if part > 1.0 - mixed else "minority" if part < mixed else "mixed"


def _p50_rate(requests: list[list], method: str | None = None) -> float | None:
    """The median of ``tokens / seconds`` over a run's requests (of ``method`` where given)."""
    rates = [r[1] / r[2] for r in requests if r[2] > 0 and (method is None or r[3] == method)]
    return statistics.median(rates) if rates else None


def request_rates(results: list[dict], rows: dict[str, str], row: str,
                  mixed: float) -> dict[tuple[str, str], list[float]]:
    """(load group, share) -> per (cell, repeat, method) of ``row``: its requests' p50 rate over the p50 of the
    same repeat's run of the method's own row. Runs without each request's method (before session 60) are
    skipped."""
    out: dict[tuple[str, str], list[float]] = defaultdict(list)
    for workload, level, cell_rows, rep, run in runs_of(results, row):
        requests = run.get("requests") or []
        if not requests or len(requests[0]) < 4:
            continue
        for method, n in Counter(r[3] for r in requests).items():
            own_row = rows.get(method)
            if own_row is None:
                continue
            if own_row not in cell_rows:
                raise PoolError(f"{workload} c = {level}: no {own_row!r} row for {row}'s {method}")
            own = _p50_rate(cell_rows[own_row]["runs"][rep]["requests"])
            mine = _p50_rate(requests, method)
            if own and mine:
                out[(group_of(int(level)), share_of(n, len(requests), mixed))].append(mine / own)
    return out


def classes_by_workload(result: dict, row: str) -> dict[str, str]:
    """Each prompt class (its short hash in the snapshots) to the first workload whose cells show it."""
    owner: dict[str, str] = {}
    for workload, levels in result["workloads"].items():
        for cell in levels.values():
            for snap in cell.get("auto_choice_by_row", {}).get(row, []):
                owner.setdefault(snap["class"], workload)
    return owner


def chooser_view(results: list[dict], rows: dict[str, str], row: str) -> dict[tuple[str, str], list[float]]:
    """(load group, "winner" or "loser") -> per cell with a winner: the chooser's rate of a candidate at the end
    of the cell over the per-user p50 of the method's own row in that cell."""
    out: dict[tuple[str, str], list[float]] = defaultdict(list)
    for result in results:
        owner = classes_by_workload(result, row)
        for workload, levels in result["workloads"].items():
            for level, cell in levels.items():
                for snap in cell.get("auto_choice_by_row", {}).get(row, []):
                    if owner.get(snap["class"]) != workload or str(snap["bucket"]) != level or not snap["winner"]:
                        continue
                    for method, arm in snap["arms"].items():
                        own_row = rows.get(method)
                        own = cell["rows"].get(own_row, {}).get("per_user_tok_s_p50") if own_row else None
                        if own and arm["tok_s"] > 0:
                            role = "winner" if method == snap["winner"] else "loser"
                            out[(group_of(int(level)), role)].append(arm["tok_s"] / own)
    return out


def _table(groups: dict[tuple[str, str], list[float]], columns: tuple[str, ...], head: str, note: str) -> str:
    header = [f"| load | {' | '.join(f'{head} {c} (n)' for c in columns)} |", "|---" * (len(columns) + 1) + "|"]
    return by_group(groups, header, lambda v: f"{statistics.geometric_mean(v):.3f} ({len(v)})", note, columns)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.mix_rates", description=__doc__.split("\n\n")[0])
    p.add_argument("result", type=Path, nargs="+", help="speedup.json or .json.gz of bench speedup runs")
    p.add_argument("--rows", type=pairs, default=pairs("dspark=dspark,ngram=ngram-gated"),
                   help="method=row: each method's own row (default dspark=dspark,ngram=ngram-gated)")
    p.add_argument("--row", default="auto", help="the row of method auto to read (default auto; auto-alternate: "
                   "every batch half each method)")
    p.add_argument("--mixed", type=float, default=0.15,
                   help="a method is a minority below this share of a run's requests, alone-ish above one minus "
                        "it (default 0.15)")
    args = p.parse_args(argv)
    if not 0.0 < args.mixed < 0.5:
        p.error(f"--mixed must be in (0, 0.5), got {args.mixed}")
    try:
        results = [load(path) for path in args.result]
        rates = request_rates(results, args.rows, args.row, args.mixed)
        view = chooser_view(results, args.rows, args.row)
    except PoolError as exc:
        print(f"mix_rates: {exc}", file=sys.stderr)
        return 2
    if not rates and not view:
        print(f"mix_rates: no {args.row} run with per-request methods or chooser snapshots in these results",
              file=sys.stderr)
        return 2
    out = []
    if rates:
        out.append(_table(rates, SHARES, "p50 rate / own row,",
                          f"Per (cell, repeat, method) of {args.row}: the p50 decode rate of the method's requests "
                          "over the p50 of the same repeat's run of its own row; the columns by the method's share "
                          f"of the run's requests (minority < {args.mixed:g}). Geometric means."))
    else:
        out.append(f"No {args.row} run records each request's method (runs before session 60).\n")
    if view:
        out.append(_table(view, ("winner", "loser"), "chooser's rate / own row p50,",
                          "The chooser's decayed rate of each candidate at the end of each cell over the per-user "
                          "p50 of the method's own row in that cell. Selection is in it: compare c = 1, where no "
                          "batch mixes."))
    sys.stdout.write("\n".join(out))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
