"""What a resting drafter still costs: a row's runs where the gate drafted (almost) nothing, against `none`.

    python -m bench.resting_costs docs/results/gpu/s18/runBH/speedup.json.gz docs/results/gpu/s18/runBI/speedup.json.gz

Why: issue 6 asks that scheduled DSpark is never slower than `none`. Where the gate rests, the row serves the
same tokens with the same plain steps as `none`, so whatever it loses there is overhead, not a bad decision.
A cell's ratio mixes runs that drafted with runs that did not; this keeps only the repeats where the row's
gate let at most ``--max-drafted`` steps draft, pairs each with `none`'s run of the same repeat (they ran back
to back), and prints per concurrency the median wall-time ratio and where the extra time went: the engine's
phase times per step (``phase_ms_per_step``, in µs), the extra time per prompt step, the capture steps a
run took (feature captures before probes), and its rest-span steps (recorded from session 33 on). It reads
only what ``bench speedup`` records; nothing is timed here.
"""
from __future__ import annotations

import argparse
import statistics
from pathlib import Path

from bench.speedup_pool import BASELINE, PoolError, each_run_pairs, load, step_kind


def resting_pairs(runs: list[dict], row: str, max_drafted: int,
                  no_captures: bool = False) -> dict[int, list[tuple[dict, dict]]]:
    """Concurrency -> (baseline run, row run) of every repeat where ``row``'s gate drafted ≤ ``max_drafted``
    steps (and, with ``no_captures``, ran no capture step either), over every workload of every run; runs
    of different tables pool by concurrency."""
    out: dict[int, list[tuple[dict, dict]]] = {}
    for _, level, pairs in each_run_pairs(runs, row):
        for base, run in pairs:
            if sum(run.get("gate_drafted_by", {}).values()) <= max_drafted and not (
                    no_captures and step_kind(run, "capture")[0]):
                out.setdefault(int(level), []).append((base, run))
    return dict(sorted(out.items()))


def costs(pairs: list[tuple[dict, dict]]) -> dict:
    """Medians over the pairs: wall ratio (row over baseline), µs per step by phase (row minus baseline),
    ms per prompt step (row minus baseline) and the row's mean capture steps per run."""
    phases = list(pairs[0][0]["phase_ms_per_step"])
    extra_prompt = []
    for base, run in pairs:
        (b_n, b_ms, _), (r_n, r_ms, _) = step_kind(base, "prompt"), step_kind(run, "prompt")
        if b_n and r_n:
            extra_prompt.append(r_ms / r_n - b_ms / b_n)
    return {
        "runs": len(pairs),
        "wall_ratio": statistics.median(run["wall_s"] / base["wall_s"] for base, run in pairs),
        "wall_geomean": statistics.geometric_mean(run["wall_s"] / base["wall_s"] for base, run in pairs),
        "phase_us": {k: 1000 * statistics.median(run["phase_ms_per_step"].get(k, 0.0) - base["phase_ms_per_step"][k]
                                                 for base, run in pairs) for k in phases},
        "prompt_step_ms": statistics.median(extra_prompt) if extra_prompt else None,
        "captures": statistics.fmean(step_kind(run, "capture")[0] for _, run in pairs),
        # rest-span steps a run: recorded from session 33 on (None for older runs)
        "span_steps": statistics.fmean(run["gate_rest_span_steps"] for _, run in pairs)
        if all("gate_rest_span_steps" in run for _, run in pairs) else None,
    }


def table(by_level: dict[int, list[tuple[dict, dict]]], row: str) -> str:
    if not by_level:
        return f"no run of {row!r} rested"
    phases = list(next(iter(by_level.values()))[0][0]["phase_ms_per_step"])
    head = (f"| c | resting runs | wall {row} / {BASELINE} (median) | (geometric mean) | "
            + " | ".join(f"{p} µs/step" for p in phases) + " | prompt step +ms | captures/run | span steps/run |")
    lines = [head, "|---" * (len(phases) + 7) + "|"]
    for level, pairs in by_level.items():
        c = costs(pairs)
        prompt = "-" if c["prompt_step_ms"] is None else f"{c['prompt_step_ms']:+.3f}"
        lines.append(f"| {level} | {c['runs']} | {c['wall_ratio']:.4f} | {c['wall_geomean']:.4f} | "
                     + " | ".join(f"{c['phase_us'][p]:+.1f}" for p in phases)
                     + f" | {prompt} | {c['captures']:.2f} | "
                     + ("-" if c["span_steps"] is None else f"{c['span_steps']:.1f}") + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.resting_costs", description=__doc__.splitlines()[0])
    p.add_argument("result", type=Path, nargs="+", help="speedup.json or .json.gz files of bench speedup runs")
    p.add_argument("--row", default="dspark", help="the gated row to read (default dspark)")
    p.add_argument("--max-drafted", type=int, default=1,
                   help="a repeat counts as resting when its gate let at most this many steps draft (default 1)")
    p.add_argument("--no-captures", action="store_true",
                   help="also require no capture step (feature captures before probes and resumptions): runs "
                        "that did no drafter work at all, whose whole difference from `none` is overhead; "
                        "--max-drafted 0 --no-captures, and the same for --row none-aa (the A/A row never "
                        "drafts), gives the noise floor beside it")
    args = p.parse_args(argv)
    try:
        runs = [load(path) for path in args.result]
        print(table(resting_pairs(runs, args.row, args.max_drafted, args.no_captures), args.row))
    except PoolError as e:
        p.error(str(e))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
