"""A row's runs by what its drafter did in them, against `none`: none of its work, only captures, or drafting.

    python -m bench.run_kinds docs/results/gpu/s32/runC{S,T,U,V,W}/speedup.json.gz [--row dspark]
        [--runs | --where | --same-path]

Why: where the gate rests (c >= 16), a cell's ratio to `none` mixes runs in which the drafter did nothing
(their whole difference is host time), runs that only captured target features (a probe's announcement),
and runs that drafted a few steps (probes, explorations, the drain's small buckets). A probe's drafting
steps cost 3-5 plain steps each at c >= 16 and desynchronise the closed loop (``bench.step_split``), so a
run holding one runs several percent behind while most runs hold none. This prints, per concurrency, each
kind's runs (count and share), their throughput ratio to `none`'s run of the same repeat (geometric mean, a
bootstrap 95% interval), and its share of the row's loss: the kind's share of runs times its log ratio,
over the row's mean log ratio. The A/A row (``none-aa``) of the same runs gives the noise floor. It reads
only what ``bench speedup`` records; nothing is timed here.

``--where`` prints, per kind, where the runs' time went against `none`'s run of the same repeat: the extra prompt
steps a run, and the extra milliseconds a run in prompt steps (with or without drafts beside them) against
those in decode steps (drafting, capture and plain). Why: at c = 32 (session 42, runs DQ and DR) the drafted
runs lost ~25 ms a run in ~4.6 extra prompt steps while their decode steps ran ~2 ms faster than `none`'s:
the loss was not the drafting steps but the lockstep a drafting step breaks (``bench.step_split``).

``--same-path`` compares only the row's runs that did the same work as `none`'s run of the same repeat: nothing
drafted, and the same tokens in the same number of steps (so the same sampled answers). Their throughput ratio
is the host cost of the row's machinery alone, free of the sample path; the A/A row's ratio in the same
repeats says how far a run with identical work moves by itself. Why: with sampled answers at turn lengths, one
probe step changes a request's random draws and with them its answer and the closed loop's tail (session 46,
run EB: knowledge c = 32, one probe step, 207 steps against `none`'s 191 and 0.93x; the two runs of that cell
where the row rested took the same 188 and 172 steps as `none` and ran within 0.6% of it).

``--runs`` lists every run instead, cell by cell in repeat order: its kind's initial, its ratio and its
drafting steps ("d1.38/120", "r0.99/0"). Why: a pooled cell hides the run in which a gate rested where it
drafts elsewhere (session 40, run DI: the old charge rule drafted 3 steps in two of coding's c = 1 runs,
110-129 in the other fourteen), and such a claim needs a command that shows it.
"""
from __future__ import annotations

import math
import statistics

from bench.speedup_pool import each_run_pairs, row_tool_main, step_kind
from bench.stats import geomean_interval

KINDS = ("rested", "captured", "drafted")


def kind(run: dict) -> str:
    """What the drafter did in one timed run: "drafted" (a step drafted, beside prompt chunks or not),
    "captured" (target features captured, nothing drafted), else "rested"."""
    if step_kind(run, "draft")[0] or step_kind(run, "prompt_draft")[0]:
        return "drafted"
    return "captured" if step_kind(run, "capture")[0] else "rested"


def ratios_by_kind(runs: list[dict], row: str) -> dict[int, dict[str, list[float]]]:
    """Concurrency -> kind -> the row's throughput ratios to `none`'s run of the same repeat, over every
    workload of every result (results of different tables pool by concurrency)."""
    out: dict[int, dict[str, list[float]]] = {}
    for _workload, level, pairs in each_run_pairs(runs, row):
        by = out.setdefault(int(level), {k: [] for k in KINDS})
        for base, run in pairs:
            by[kind(run)].append(run["throughput_tok_s"] / base["throughput_tok_s"])
    return dict(sorted(out.items()))


def table(runs: list[dict], row: str, resamples: int = 10_000) -> str:
    lines = [f"| c | kind | runs | share | {row} / none | share of the loss |", "|---|---|---|---|---|---|"]
    for level, by in ratios_by_kind(runs, row).items():
        total = sum(len(v) for v in by.values())
        mean_log = math.fsum(math.log(r) for v in by.values() for r in v) / total
        for k in KINDS:
            rs = by[k]
            if not rs:
                continue
            g, lo, hi = geomean_interval(rs, resamples)
            share = len(rs) / total
            part = share * math.log(g) / mean_log if mean_log < 0 else float("nan")
            lines.append(f"| {level} | {k} | {len(rs)} | {share:.0%} | {g:.3f} ({lo:.3f}-{hi:.3f}) | "
                         + ("-" if math.isnan(part) else f"{part:.0%}") + " |")
    return "\n".join(lines)


def run_lines(runs: list[dict], row: str) -> str:
    """Every run of ``row``, per result and cell, in repeat order: kind initial, throughput ratio to `none`'s
    run of the same repeat, drafting steps (beside prompt chunks or not)."""
    lines = [f"| result | workload | c | {row} runs: kind, ratio to none / drafting steps |", "|---|---|---|---|"]
    for i, result in enumerate(runs, start=1):
        for workload, level, pairs in each_run_pairs([result], row):
            cells = [f"{kind(run)[0]}{run['throughput_tok_s'] / base['throughput_tok_s']:.2f}/"
                     f"{step_kind(run, 'draft')[0] + step_kind(run, 'prompt_draft')[0]}" for base, run in pairs]
            lines.append(f"| {i} | {workload} | {level} | {' '.join(cells)} |")
    return "\n".join(lines)


PROMPT_KINDS = ("prompt", "prompt_draft")          # steps that carried prompt chunks, drafts beside them or not
DECODE_KINDS = ("draft", "capture", "plain")


def _steps_ms(run: dict, names: tuple[str, ...]) -> tuple[int, float]:
    """Steps and milliseconds of the named step kinds of one timed run, summed."""
    parts = [step_kind(run, n) for n in names]
    return sum(p[0] for p in parts), sum(p[1] for p in parts)


def cohort(run: dict) -> float:
    """The mean number of requests that finished in a step where any finished (``finish_cohorts``, recorded by
    ``bench speedup`` since session 43): ~1 where answers end apart, the cohort size where they end in
    lockstep."""
    steps = sum(run["finish_cohorts"].values())
    return sum(int(n) * k for n, k in run["finish_cohorts"].items()) / steps


def where(runs: list[dict], row: str) -> str:
    """``--where``: per concurrency and kind, the mean over the kind's runs of the row's extra prompt steps,
    extra ms in prompt steps, extra ms in decode steps and extra wall ms, each against `none`'s run of the
    same repeat, beside `none`'s mean wall ms; and, where the runs record it, the requests a finishing step
    finished, the row's beside `none`'s (``cohort``)."""
    acc: dict[tuple[int, str], list[dict]] = {}
    for _workload, level, pairs in each_run_pairs(runs, row):
        for base, run in pairs:
            ps, pms = _steps_ms(run, PROMPT_KINDS)
            bps, bpms = _steps_ms(base, PROMPT_KINDS)
            got = {"steps": ps - bps, "prompt_ms": pms - bpms,
                   "decode_ms": _steps_ms(run, DECODE_KINDS)[1] - _steps_ms(base, DECODE_KINDS)[1]}
            if "wall_s" in run and "wall_s" in base:
                got["wall"] = (1e3 * (run["wall_s"] - base["wall_s"]), 1e3 * base["wall_s"])
            if run.get("finish_cohorts") and base.get("finish_cohorts"):
                got["cohort"] = (cohort(run), cohort(base))
            acc.setdefault((int(level), kind(run)), []).append(got)
    lines = [f"| c | kind | runs | +prompt steps a run | +ms in prompt steps | +ms in decode steps | +wall ms "
             f"(none's) | requests a finishing step (none's) |", "|---|---|---|---|---|---|---|---|"]
    for level in sorted({lv for lv, _ in acc}):
        for k in KINDS:
            got = acc.get((level, k))
            if not got:
                continue
            mean = [statistics.fmean(g[f] for g in got) for f in ("steps", "prompt_ms", "decode_ms")]
            cols = []
            for f, fmt in (("wall", "{:+.1f} ({:.0f})"), ("cohort", "{:.2f} ({:.2f})")):
                pairs_ = [g[f] for g in got if f in g]
                cols.append(fmt.format(statistics.fmean(p[0] for p in pairs_), statistics.fmean(p[1] for p in pairs_))
                            if pairs_ else "-")
            lines.append(f"| {level} | {k} | {len(got)} | {mean[0]:+.1f} | {mean[1]:+.1f} | {mean[2]:+.1f} | "
                         f"{cols[0]} | {cols[1]} |")
    return "\n".join(lines)


AA_ROW = "none-aa"


def same_path(runs: list[dict], row: str, resamples: int = 10_000) -> str:
    """``--same-path``: per concurrency, the row's runs that drafted nothing and emitted the same tokens in the
    same steps as `none`'s run of the same repeat; their throughput ratio to `none` (geometric mean, bootstrap
    95% interval), and the A/A row's ratio in the same repeats where the results have it."""
    acc: dict[int, tuple[list[float], list[float]]] = {}
    total: dict[int, int] = {}
    for result in runs:
        for workload, level, pairs in each_run_pairs([result], row):
            rows = result["workloads"][workload][level]["rows"]
            aa = rows.get(AA_ROW, {}).get("runs", [])
            for i, (base, run) in enumerate(pairs):
                total[int(level)] = total.get(int(level), 0) + 1
                same = run.get("tokens") == base.get("tokens") and run.get("steps") == base.get("steps")
                if kind(run) == "drafted" or not same:
                    continue
                mine, floor = acc.setdefault(int(level), ([], []))
                mine.append(run["throughput_tok_s"] / base["throughput_tok_s"])
                if i < len(aa):
                    floor.append(aa[i]["throughput_tok_s"] / base["throughput_tok_s"])
    lines = [f"| c | same-path runs | {row} / none | {AA_ROW} / none, same repeats |", "|---|---|---|---|"]
    for level in sorted(total):
        mine, floor = acc.get(level, ([], []))
        cols = []
        for rs in (mine, floor):
            if rs:
                g, lo, hi = geomean_interval(rs, resamples)
                cols.append(f"{g:.3f} ({lo:.3f}-{hi:.3f})")
            else:
                cols.append("-")
        lines.append(f"| {level} | {len(mine)} of {total[level]} | {cols[0]} | {cols[1]} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    return row_tool_main("python -m bench.run_kinds", __doc__.splitlines()[0], table, argv,
                         "the row to split (default dspark; none-aa: the noise floor)",
                         other=[("--runs", "list every run instead, cell by cell in repeat order: kind, ratio to "
                                           "none, drafting steps", run_lines),
                                ("--where", "print, per kind, the extra prompt steps and the extra ms in prompt "
                                            "steps and in decode steps against none's runs instead", where),
                                ("--same-path", "compare only the runs that drafted nothing and emitted the same tokens "
                                                "in the same steps as none's (the A/A row beside them)", same_path)])


if __name__ == "__main__":
    raise SystemExit(main())
