"""Ratios to `none` with the host's speed taken out, for runs where a row rested: a sharper "never slower".

    python -m bench.host_adjust docs/results/gpu/s61/runTA/speedup/speedup.json.gz [more results] [--row dspark]
        [--fit-from docs/results/gpu/s5*/run*/speedup/speedup.json.gz]

Why: at 0.5B a decode step is bound by the host (Python, kernel launches), and the host's speed drifts run by
run (bench/host_drift.py). The A/A row (``none-aa``, a second ``none``) shows how much: over sessions 50-61's
runs its per-repeat throughput ratio to `none` spread by 4.8% (SD of the log ratio, 690 pairs), so a few
percent below 1 in a cell of scheduled dspark could not be told from the host. Most of that spread is the host:
the ratio of the two runs' host-only milliseconds per token (output and commit: Python, no kernels) explains
93% of it (slope -0.375 on the log scale), and what is left has an SD of 1.2%.

So each repeat's ratio is corrected by the same fit: ``log ratio - slope * log host ratio``. That is only
sound where the row's own host work per token is `none`'s, which holds where the row rested: over those
sessions' runs where scheduled dspark drafted in at most 5% of its steps, the median host ratio was
1.000-1.006 at every load, while drafting runs spend less host time per token (0.75 at c = 1: several tokens a
step). Runs that drafted more than ``REST_SHARE`` of their steps are therefore left as they are and marked.
The fit comes from the A/A pairs of the same results (or ``--fit-from``), and the A/A row's corrected ratios
are printed beside the row's: their spread is the corrected rule's noise floor.
"""
from __future__ import annotations

import argparse
import math
import statistics
from dataclasses import dataclass
from pathlib import Path

from bench.host_drift import host_ms
from bench.gate_trace import markdown
from bench.speedup_pool import SECOND, PoolError, each_run_pairs, load, step_kind

AA_ROW = SECOND        # the A/A row: a second run of `none` in each repeat
REST_SHARE = 0.05      # a run rests when at most this share of its steps drafted
MIN_PAIRS = 20         # A/A pairs a fit needs
BANDS = (0.99, 0.98, 0.97)


@dataclass(frozen=True)
class Fit:
    """Least squares of the A/A row's log ratio on its log host ratio (through the means)."""
    slope: float
    r2: float
    sd: float          # SD of the log ratio
    sd_left: float     # SD of what the host ratio leaves
    pairs: int


def host_per_token(run: dict) -> float | None:
    """Host-only ms per generated token of a timed run (None without phase times or tokens)."""
    ms = host_ms(run)
    if ms is None or not run.get("tokens") or not run.get("steps"):
        return None
    return ms * run["steps"] / run["tokens"]


def drafted_share(run: dict) -> float:
    """The share of a timed run's steps that drafted."""
    return step_kind(run, "draft")[0] / max(run.get("steps", 0), 1)


def log_pairs(runs: list[dict], row: str) -> list[tuple[str, str, float, float, float]]:
    """(workload, concurrency, log throughput ratio, log host ratio, drafted share) of each repeat of ``row``
    against `none`'s run of the same repeat; repeats without phase times are left out."""
    out = []
    for workload, level, pairs in each_run_pairs(runs, row):
        for base, run in pairs:
            hb, hr = host_per_token(base), host_per_token(run)
            if hb and hr and base.get("throughput_tok_s") and run.get("throughput_tok_s"):
                out.append((workload, level, math.log(run["throughput_tok_s"] / base["throughput_tok_s"]),
                            math.log(hr / hb), drafted_share(run)))
    return out


def fit(points: list[tuple[float, float]]) -> Fit:
    """The slope of log ratio on log host ratio over (log host ratio, log ratio) points."""
    if len(points) < MIN_PAIRS:
        raise PoolError(f"{len(points)} A/A pairs with phase times: a fit needs {MIN_PAIRS} "
                        f"(pass --fit-from with runs that have a {AA_ROW!r} row)")
    xs, ys = zip(*points)
    try:
        r = statistics.correlation(xs, ys)
    except statistics.StatisticsError as e:       # a constant input
        raise PoolError("the A/A pairs' host ratios or throughput ratios do not vary: nothing to fit") from e
    sd = statistics.pstdev(ys)
    return Fit(slope=statistics.linear_regression(xs, ys).slope, r2=r * r, sd=sd,
               sd_left=sd * math.sqrt(max(1.0 - r * r, 0.0)), pairs=len(ys))


def pairs_of(runs: list[dict], row: str) -> list[tuple[str, str, float, float, float]]:
    """``log_pairs`` of every run that has ``row`` (and `none`) in each of its cells; the others are skipped,
    so that a glob of several sessions' results can be passed whole."""
    out = []
    for run in runs:
        try:
            out += log_pairs([run], row)
        except PoolError:
            continue
    return out


def fit_runs(runs: list[dict]) -> Fit:
    """The fit over every A/A pair of the runs that have the A/A row."""
    return fit([(h, y) for *_, y, h, _share in pairs_of(runs, AA_ROW)])


def correct(y: float, h: float, share: float, f: Fit) -> float | None:
    """A repeat's log ratio with the host taken out, or None where it drafted (no sound correction there)."""
    return y - f.slope * h if share <= REST_SHARE else None


def corrected(pairs: list[tuple[str, str, float, float, float]], f: Fit):
    """{(workload, concurrency): [(raw log ratio, corrected log ratio or None where the run drafted)]}."""
    cells: dict[tuple[str, str], list[tuple[float, float | None]]] = {}
    for workload, level, y, h, share in pairs:
        cells.setdefault((workload, level), []).append((y, correct(y, h, share, f)))
    return cells


def cell_text(values: list[tuple[float, float | None]]) -> str:
    raw = math.exp(statistics.fmean(y for y, _ in values))
    if any(c is None for _, c in values):
        return f"{raw:.3f} (drafted)"
    return f"{raw:.3f} → **{math.exp(statistics.fmean(c for _, c in values)):.3f}**"


def band_counts(cells: dict) -> str:
    """How many resting cells' corrected geometric means fall below each band."""
    means = [statistics.fmean(c for _, c in v) for v in cells.values() if all(c is not None for _, c in v)]
    counts = ", ".join(f"< {b:.2f}: {sum(m < math.log(b) for m in means)}" for b in BANDS)
    return f"{len(means)} resting cells of {len(cells)}; corrected below {counts}"


def pooled(pairs: list[tuple[str, str, float, float, float]], f: Fit) -> dict[str, tuple[int, float, float]]:
    """{concurrency: (resting repeats, corrected geometric mean, half-width of its 95% interval)} over every
    resting repeat of every workload: the steady price of resting, with the host taken out."""
    by: dict[str, list[float]] = {}
    for _workload, level, y, h, share in pairs:
        c = correct(y, h, share, f)
        if c is not None:
            by.setdefault(level, []).append(c)
    return {level: (len(v), math.exp(statistics.fmean(v)),
                    1.96 * statistics.stdev(v) / math.sqrt(len(v)) if len(v) > 1 else math.nan)
            for level, v in sorted(by.items(), key=lambda kv: int(kv[0]))}


def pooled_table(runs: list[dict], names: list[str], f: Fit) -> str:
    heads, body = ["row"], []
    found = {name: pooled(pairs_of(runs, name), f) for name in names}
    levels = sorted({level for p in found.values() for level in p}, key=int)
    for name, p in found.items():
        body.append([f"`{name}`"] + [f"{p[c][1]:.4f} ± {p[c][2]:.4f} (n {p[c][0]})" if c in p else "–"
                                     for c in levels])
    return markdown(heads + [f"c = {c}" for c in levels], body)


def table(runs: list[dict], row: str, f: Fit) -> str:
    lines = [f"Fit on {f.pairs} A/A pairs: slope {f.slope:.3f}, R² {f.r2:.3f}; SD of the A/A log ratio "
             f"{f.sd:.4f}, left after the host {f.sd_left:.4f}.", ""]
    for name in dict.fromkeys([row, AA_ROW]):
        cells = corrected(pairs_of(runs, name), f)
        levels = list(dict.fromkeys(level for _, level in cells))
        workloads = list(dict.fromkeys(w for w, _ in cells))
        body = [[w] + [cell_text(cells[(w, c)]) if (w, c) in cells else "–" for c in levels] for w in workloads]
        lines += [f"`{name}`: throughput ratio to `none`, geometric mean over repeats, raw → corrected "
                  f"(\"drafted\": a repeat drafted in more than {REST_SHARE:.0%} of its steps, not corrected)", "",
                  markdown(["workload"] + [f"c = {c}" for c in levels], body), "",
                  f"`{name}`: {band_counts(cells)}.", ""]
    lines += ["Resting repeats pooled over the workloads, corrected: geometric mean ± half its 95% interval "
              "(n repeats)", "", pooled_table(runs, list(dict.fromkeys([row, AA_ROW])), f)]
    return "\n".join(lines).rstrip() + "\n"


# The fit on sessions 50-60's A/A pairs (640, H100 and H200): the slope ``host_line`` corrects new runs with, so
# that a run's own A/A row is judged out of sample (fitted on its own 30-50 pairs it would look tighter than it is)
HISTORY = Fit(slope=-0.384, r2=0.934, sd=0.0473, sd_left=0.0121, pairs=640)


def host_line(result: dict, row: str) -> str:
    """One markdown line for ``bench speedup``'s table: ``row``'s and the A/A row's resting cells with the host
    taken out by ``HISTORY``'s slope, and this run's own slope beside it ("" without the A/A row or phase
    times)."""
    try:
        row_cells = corrected(log_pairs([result], row), HISTORY)
        aa_cells = corrected(log_pairs([result], AA_ROW), HISTORY)
    except PoolError:
        return ""
    if not row_cells or not aa_cells:
        return ""
    try:
        own = fit_runs([result])
        mine = f"; this run's {own.pairs} A/A pairs alone give {own.slope:.3f}, R² {own.r2:.2f}"
    except PoolError:
        mine = ""
    return (f"With the host's speed taken out (`bench.host_adjust`, slope {HISTORY.slope} from "
            f"{HISTORY.pairs} earlier A/A pairs{mine}): {row}'s {band_counts(row_cells)}; the A/A row's "
            f"{band_counts(aa_cells)}.")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.host_adjust", description=__doc__.split("\n\n")[0])
    p.add_argument("result", type=Path, nargs="+", help="speedup.json or .json.gz files of bench speedup runs")
    p.add_argument("--row", default="dspark", help="the row to correct (default: dspark, the scheduled row)")
    p.add_argument("--fit-from", type=Path, nargs="+", default=None,
                   help="results whose A/A pairs give the fit (default: the results above; they need a "
                        f"{AA_ROW!r} row)")
    args = p.parse_args(argv)
    try:
        runs = [load(path) for path in args.result]
        f = fit_runs([load(path) for path in args.fit_from] if args.fit_from else runs)
        print(table(runs, args.row, f))
    except PoolError as e:
        p.error(str(e))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
