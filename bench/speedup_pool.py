"""Issue 6's "never slower" verdict over several runs of ``bench speedup``, with intervals instead of one p50.

    python -m bench.speedup_pool docs/results/gpu/s18/runBH/speedup.json.gz docs/results/gpu/s18/runBI/speedup.json.gz

Why: a run's per-cell verdict is the p50 of 3-5 per-repeat ratios, and on the H200 one run of a commit said
2 failing cells where the next run of the same commit, in the same lease, said 6 (session 18, BH and BI). So
a single run cannot tell a cell that is a few percent slower every time from one that had an unlucky run. This
pools every run's per-repeat ratios (each repeat's row against ``none`` in the same repeat: they ran back to
back) per cell, and prints their geometric mean with a bootstrap 95% interval (``bench.stats``), for the
throughput and the per-user rate. A cell is **slower** when the whole interval lies below 1, **faster** when it
lies above. The A/A row (``none-aa``, a second ``none``) in the same runs shows how often that happens to a row
that cannot differ: its count of "slower" cells is the rule's false alarms. On the H200 that count was 3-6 of
25 cells per run (sessions 17-18), more than the 5% a 95% interval promises, so a run's repeats share more
than the bootstrap assumes (their order in the run, the machine's drift): read a row's count against the A/A
row's, not one cell's interval as a verdict.

Runs must share their workloads and concurrencies, or, with ``--shared``, are pooled over the cells all of them
have (session 30: a full table and a run of c = 16 and 32 alone, of one commit); pool runs of one commit (the
files' ``COMMIT`` neighbours are printed when present), or the interval mixes code versions.
"""
from __future__ import annotations

import argparse
import gzip
import json
import math
import random
import statistics
from pathlib import Path

from bench.arg_types import fraction
from bench.stats import bootstrap_bounds, geomean_interval, median_interval

BASELINE = "none"
SECOND = "none-aa"       # the A/A row: a second run of the baseline in each repeat (``pooled_cell``'s ``both``)
RATIOS = (("throughput_ratio", "throughput"), ("per_user_ratio", "per user"))


class PoolError(ValueError):
    """Runs that cannot be pooled: a missing file, row or cell, or runs of different shapes."""


def load(path: Path) -> dict:
    opener = gzip.open if path.suffix == ".gz" else open
    try:
        with opener(path, "rt") as f:
            result = json.load(f)
    except (OSError, json.JSONDecodeError) as e:
        raise PoolError(f"{path}: {e}") from e
    if "workloads" not in result:
        raise PoolError(f"{path} is not a bench speedup result (no 'workloads')")
    marker = path.parent / "DEVICE"      # a run older than the field, its card written down beside it
    if not result.get("device") and marker.exists():
        result["device"] = marker.read_text().strip()
    return result


def check_one_card(runs: list[dict], paths: list[Path]) -> None:
    """PoolError when two runs name different cards (``device``, recorded from session 37 on). Why: a
    ratio to `none` is a property of one card's step costs and its host, and the gate decides by that
    card's profile (session 37: on an H100 the gate drafted at c = 32 where on the H200 it rested), so runs
    of two cards are two results, not one sample. Runs without the field (older than session 37) and no
    ``DEVICE`` file beside them pool with any."""
    named = {r["device"]: path for r, path in zip(runs, paths) if r.get("device")}
    longest = max(named, key=len, default=None)
    if any(not same_card(d, longest) for d in named):
        raise PoolError("the runs timed different cards: " + ", ".join(f"{p} on {d}" for d, p in named.items())
                        + " (pass --mixed-devices to pool them anyway)")


def same_card(a: str, b: str) -> bool:
    """One name the other's word prefix: a hand-written ``DEVICE`` ("NVIDIA H100") is the card that
    ``torch.cuda.get_device_name`` spells out ("NVIDIA H100 80GB HBM3"); "NVIDIA H100 PCIe" is not."""
    x, y = sorted((a.split(), b.split()), key=len)
    return y[:len(x)] == x


def cells(runs: list[dict]) -> list[tuple[str, str]]:
    """(workload, concurrency) of every cell, in the first run's order; every run must have them all."""
    first = [(w, c) for w, levels in runs[0]["workloads"].items() for c in levels]
    for i, r in enumerate(runs[1:], start=2):
        other = [(w, c) for w, levels in r["workloads"].items() for c in levels]
        if sorted(other) != sorted(first):
            raise PoolError(f"run {i} has other cells than run 1: pool runs of one table")
    return first


def shared_cells(runs: list[dict]) -> list[dict]:
    """The runs cut to the cells every one of them has (workloads and concurrencies in run 1's order), so
    that ``cells`` accepts them; the results themselves are not changed."""
    common = set.intersection(*({(w, c) for w, levels in r["workloads"].items() for c in levels} for r in runs))
    if not common:
        raise PoolError("the runs share no cell")
    return [{**r, "workloads": {w: {c: cell for c, cell in levels.items() if (w, c) in common}
                                for w, levels in r["workloads"].items() if any((w, c) in common for c in levels)}}
            for r in runs]


def repeat_pairs(runs: list[dict], row: str):
    """(workload, concurrency, [(baseline run, row run), ...]) per cell: each repeat of ``row`` in every run
    beside the baseline's run of the same repeat (they ran back to back)."""
    for workload, level in cells(runs):
        pairs = []
        for r in runs:
            rows = r["workloads"][workload][level]["rows"]
            if row not in rows or BASELINE not in rows:
                raise PoolError(f"no {row!r} or {BASELINE!r} row at {workload} c = {level}")
            pairs += zip(rows[BASELINE]["runs"], rows[row]["runs"])
        yield workload, level, pairs


def each_run_pairs(runs: list[dict], row: str):
    """``repeat_pairs`` of each run on its own: runs of different tables (a full table and a run of c = 16
    and 32 alone) pool by concurrency, and a cell of each run comes apart (``bench.exploration_cost`` counts
    them; ``bench.resting_costs`` pools their repeats)."""
    for run in runs:
        yield from repeat_pairs([run], row)


def step_kind(run: dict, name: str) -> tuple[int, float, int]:
    """(steps, ms, tokens) of one step kind in a timed run's ``step_kinds`` (zeros when it took none)."""
    k = run.get("step_kinds", {}).get(name, {})
    return k.get("steps", 0), k.get("ms", 0.0), k.get("tokens", 0)


def row_tool_main(prog: str, description: str, render, argv: list[str] | None, row_help: str,
                  other: tuple[str, str, object] | list[tuple[str, str, object]] | None = None) -> int:
    """The command line of a tool that reads one row of ``bench speedup`` results against the baseline
    (``bench.step_split``, ``bench.draft_step_cost``): result files, ``--row``; prints ``render(runs, row)``.
    ``other``: (flag, help, render) of a second view the flag prints instead (``bench.run_kinds --runs``), or
    a list of them, one flag at a time (``bench.run_kinds --runs`` / ``--where``)."""
    p = argparse.ArgumentParser(prog=prog, description=description)
    p.add_argument("result", type=Path, nargs="+", help="speedup.json or .json.gz files of bench speedup runs "
                                                          "with the same cells (pooled repeat by repeat)")
    p.add_argument("--row", default="dspark", help=row_help)
    views = [other] if isinstance(other, tuple) else list(other or [])
    if views:        # an empty group breaks argparse's --help (Python 3.11: "empty group")
        group = p.add_mutually_exclusive_group()
        for i, (flag, help_text, _render) in enumerate(views):
            group.add_argument(flag, action="store_const", const=i, dest="view", help=help_text)
    args = p.parse_args(argv)
    if getattr(args, "view", None) is not None:
        render = views[args.view][2]
    try:
        print(render([load(path) for path in args.result], args.row))
    except PoolError as e:
        p.error(str(e))
    return 0


def default_rows(runs: list[dict], shared: bool) -> list[str]:
    """The rows to pool when none are named: run 1's (first cell), but the baseline; with ``shared``, only
    those every run has, so that runs of other diagnostic rows (session 35: ``dspark-probe-uncut`` in one,
    ``dspark-probe-quarter`` in the other) pool the rows they share instead of refusing the first they lack."""
    workload, level = cells(runs)[0]
    rows = [r for r in runs[0]["workloads"][workload][level]["rows"] if r != BASELINE]
    if shared:
        rows = [r for r in rows if all(r in run["workloads"][workload][level]["rows"] for run in runs)]
    return rows


def pooled_cell(runs: list[dict], workload: str, level: str, row: str, key: str,
                both: bool = False) -> list[float]:
    """Every run's per-repeat ratios of ``row`` to the baseline in one cell, for one of RATIOS. With ``both``,
    to the geometric mean of the repeat's two baseline runs, `none` and `none-aa` (``SECOND``): the row's
    ratio to `none` over the square root of `none-aa`'s. Why: both are plain decoding run back to back with
    the row, so each repeat holds two samples of the baseline, and a ratio to one of them carries that one
    run's luck whole (session 37, H100 run DF: at creative c = 32 one fast `none` run per repeat put both
    `dspark` and `none-aa` at 0.88-0.92). The A/A row has no second baseline of its own, so its noise floor
    is read against `none` alone."""
    out: list[float] = []
    for i, r in enumerate(runs, start=1):
        rows = r["workloads"][workload][level]["rows"]
        if row not in rows:
            raise PoolError(f"run {i} has no row {row!r} at {workload} c = {level} (rows: {', '.join(rows)})")
        ratio = rows[row].get(key)
        if ratio is None:
            continue
        if not both:
            out += ratio["per_repeat"]
            continue
        if row == SECOND or SECOND not in rows or rows[SECOND].get(key) is None:
            raise PoolError(f"run {i} has no second baseline {SECOND!r} for {row!r} at {workload} c = {level}")
        second = rows[SECOND][key]["per_repeat"]
        if len(second) != len(ratio["per_repeat"]):
            raise PoolError(f"run {i}: {row!r} and {SECOND!r} ran different repeats at {workload} c = {level}")
        out += [x / math.sqrt(y) for x, y in zip(ratio["per_repeat"], second)]
    return out


def verdicts(runs: list[dict], row: str, resamples: int = 10_000,
             both: bool = False, median: bool = False) -> dict[tuple[str, str], dict[str, tuple]]:
    """(workload, concurrency) -> ratio name -> (geometric mean, low, high, repeats); ``median``: the cell's
    median repeat instead of the geometric mean (``bench.stats.median_interval``)."""
    interval = median_interval if median else geomean_interval
    out: dict[tuple[str, str], dict[str, tuple]] = {}
    for workload, level in cells(runs):
        out[workload, level] = {}
        for key, name in RATIOS:
            ratios = pooled_cell(runs, workload, level, row, key, both)
            if ratios:
                out[workload, level][name] = (*interval(ratios, resamples), len(ratios))
    return out


def log_ratios_by_level(runs: list[dict], row: str, key: str, both: bool = False) -> dict[str, list[list[float]]]:
    """Concurrency -> one list per workload that ran there: the logs of its pooled per-repeat ratios
    (``pooled_cell``), for the summaries over workloads."""
    levels: dict[str, list[list[float]]] = {}
    for workload, level in cells(runs):
        ratios = pooled_cell(runs, workload, level, row, key, both)
        if ratios:
            levels.setdefault(level, []).append([math.log(r) for r in ratios])
    return levels


def across_workloads(runs: list[dict], row: str, key: str, resamples: int = 2000, seed: int = 0,
                     both: bool = False, median: bool = False) -> dict[str, tuple]:
    """Per concurrency: the geometric mean over workloads of each cell's geometric mean (issue 6's summary
    row), with a bootstrap 95% interval that resamples each cell's repeats on their own (stratified: every
    workload keeps its weight); ``median``: of each cell's median repeat. -> concurrency -> (mean, low, high)."""
    centre = statistics.median if median else (lambda g: math.fsum(g) / len(g))
    levels = log_ratios_by_level(runs, row, key, both)

    def mean_of(samples: list[list[float]]) -> float:
        return math.fsum(centre(g) for g in samples) / len(samples)

    rng = random.Random(seed)
    out = {}
    for level, groups in levels.items():
        lo, hi = bootstrap_bounds([mean_of([rng.choices(g, k=len(g)) for g in groups]) for _ in range(resamples)])
        out[level] = (math.exp(mean_of(groups)), math.exp(lo), math.exp(hi))
    return out


def repeats_needed(runs: list[dict], row: str, key: str, half_width: float,
                   both: bool = False) -> dict[str, tuple[int, int]]:
    """Per concurrency: (repeats a cell needs so that the all-workloads mean's 95% interval is about
    ±``half_width`` of it, repeats a cell has now). The mean of W cell means of log ratios has variance
    Σ s_w² / n / W² at n repeats a cell (s_w: cell w's sample deviation), so n = (1.96 / (W h))² Σ s_w²,
    h = log(1 + half_width). Why: at c = 32 on the H200 the row sits ~1% from `none` and a repeat's ratio
    varies by ~3% (session 40), so whether it is below 1 is a question of how many repeats the next run
    needs, which this answers before device time is spent. A normal approximation; the bootstrap of
    ``across_workloads`` is what reports the interval."""
    h = math.log1p(half_width)
    out = {}
    for level, groups in log_ratios_by_level(runs, row, key, both).items():
        groups = [g for g in groups if len(g) >= 2]       # a cell of one repeat has no spread to read
        if not groups:
            continue
        spread = math.fsum(statistics.variance(g) for g in groups)
        out[level] = (max(2, math.ceil((1.96 / (len(groups) * h)) ** 2 * spread)), min(len(g) for g in groups))
    return out


def mark(lo: float, hi: float) -> str:
    return "slower" if hi < 1.0 else "faster" if lo > 1.0 else ""


def table(runs: list[dict], row: str, resamples: int = 10_000, both: bool = False,
          median: bool = False) -> tuple[str, dict[str, int]]:
    """A markdown table of one row's pooled cells (workloads down, concurrencies across) and its counts of
    cells slower / faster than the baseline (a cell counts once when either ratio is); ``both``: against
    both baseline runs of each repeat (``pooled_cell``); ``median``: each cell's median repeat."""
    found = verdicts(runs, row, resamples, both, median)
    workloads = list(dict.fromkeys(w for w, _ in found))
    levels = list(dict.fromkeys(c for _, c in found))
    name = f"{row} / ({BASELINE}, {SECOND})" if both else row
    lines = [f"| {name} | " + " | ".join(f"c = {c}" for c in levels) + " |", "|---" * (len(levels) + 1) + "|"]
    counts = {"cells": 0, "slower": 0, "faster": 0}
    for w in workloads:
        out = []
        for c in levels:
            cell = found.get((w, c))
            if cell is None:         # past the run's --budget-s: `bench speedup` lists it under "cut"
                out.append("not run")
                continue
            marks = {mark(lo, hi) for _, lo, hi, _ in cell.values()}
            counts["cells"] += 1
            counts["slower"] += "slower" in marks
            counts["faster"] += "faster" in marks and "slower" not in marks
            text = "<br>".join(f"{g:.3f} ({lo:.3f}-{hi:.3f})" for g, lo, hi, _ in cell.values())
            out.append(f"**{text}** ↓" if "slower" in marks else text)
        lines.append(f"| {w} | " + " | ".join(out) + " |")
    summary = [across_workloads(runs, row, key, min(resamples, 2000), both=both, median=median) for key, _ in RATIOS]
    by_level = []
    for c in levels:
        parts = [f"{s[c][0]:.3f} ({s[c][1]:.3f}-{s[c][2]:.3f})" for s in summary if c in s]
        text = "<br>".join(parts)
        ran = sum((w, c) in found for w in workloads)
        if ran < len(workloads):     # a cut cell: the mean is over the workloads that ran, and says so
            text += f"<br>({ran} of {len(workloads)} workloads)"
        by_level.append(f"**{text}** ↓" if any(s[c][2] < 1.0 for s in summary if c in s) else text)
    label = "all workloads (geometric mean of the medians)" if median else "all workloads (geometric mean)"
    lines.append(f"| {label} | " + " | ".join(by_level) + " |")
    return "\n".join(lines), counts


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.speedup_pool", description=__doc__.splitlines()[0])
    p.add_argument("result", type=Path, nargs="+", help="speedup.json or .json.gz files of bench speedup runs")
    p.add_argument("--rows", default=None,
                   help="comma-separated rows to pool (default: every row of run 1 but the baseline 'none')")
    p.add_argument("--resamples", type=int, default=10_000, help="bootstrap resamples per cell (seeded)")
    p.add_argument("--shared", action="store_true",
                   help="pool the cells every run has, instead of refusing runs of different tables, and (without "
                        "--rows) the rows every run has")
    p.add_argument("--both-baselines", action="store_true",
                   help=f"also print each row against both baseline runs of a repeat, {BASELINE!r} and {SECOND!r} "
                        "(their geometric mean): a second table per row, the A/A row's own against 'none' alone")
    p.add_argument("--median", action="store_true",
                   help="each cell's median repeat and its bootstrap interval instead of the geometric mean (robust "
                        "to the host's rare slow repeats), and the summary row from the cells' medians")
    p.add_argument("--resolution", type=fraction, default=None, metavar="HALF_WIDTH",
                   help="also print, per row and concurrency, the repeats a cell needs for the all-workloads "
                        "mean's 95%% interval to be about ±HALF_WIDTH (0.005: ±0.5%%), from the spread of the "
                        "repeats pooled (throughput ratio)")
    p.add_argument("--mixed-devices", action="store_true",
                   help="pool runs that recorded different cards (refused by default: each card is its own result)")
    args = p.parse_args(argv)
    try:
        runs = [load(path) for path in args.result]
        if not args.mixed_devices:
            check_one_card(runs, args.result)
        if args.shared:
            runs = shared_cells(runs)
        rows = args.rows.split(",") if args.rows else default_rows(runs, args.shared)
        for path, run in zip(args.result, runs):
            commit = path.parent / "COMMIT"
            device = run.get("device")
            print(f"- {path}" + (f" (commit {commit.read_text().strip()[:7]})" if commit.exists() else "")
                  + (f" on {device}" if device else ""))
        centre = "median" if args.median else "geometric mean"
        print(f"\nEach cell: the {centre} of every run's per-repeat ratio to `{BASELINE}` (throughput, then "
              "per user), with a bootstrap 95% interval; ↓ marks a cell whose interval lies below 1.\n")
        for row in rows:
            text, counts = table(runs, row, args.resamples, median=args.median)
            print(text)
            print(f"\n{row}: {counts['slower']} of {counts['cells']} cells slower than `{BASELINE}`, "
                  f"{counts['faster']} faster.\n")
            if args.resolution is not None:
                need = repeats_needed(runs, row, RATIOS[0][0], args.resolution)
                print(f"{row}: repeats a cell needs for ±{args.resolution:.1%} on the all-workloads mean "
                      "(throughput): " + ", ".join(f"c = {c}: {n} (has {have})" for c, (n, have) in need.items())
                      + "\n")
            if args.both_baselines and row != SECOND:
                text, counts = table(runs, row, args.resamples, both=True, median=args.median)
                print(text)
                print(f"\n{row}: {counts['slower']} of {counts['cells']} cells slower than both baseline runs "
                      f"(`{BASELINE}`, `{SECOND}`), {counts['faster']} faster.\n")
    except PoolError as e:
        p.error(str(e))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
