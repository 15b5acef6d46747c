"""What the gate's exploration costs where it rests, by concurrency, from `bench speedup` results.

    python -m bench.exploration_cost docs/results/gpu/s30/runCQ/speedup.json.gz [--row dspark-probe-half]

Why: where the measured gate rests (c >= 16 on four of the five workloads), scheduled dspark still drafts in
a few steps a run: probes of the losing arm (their budget, ``PROBE_BUDGET``), a new cell's or a prompt
class's exploration, requests resuming. Each such step costs several plain steps (3-5 at c >= 16 on the
top-p workloads, session 30), and a step before a probe captures features. A throughput ratio moves by
~0.5% for a change of the budget, inside its repeats' noise; the time those steps took over plain steps of
the same run is measured directly. This prints, per concurrency, over every repeat of the cells where the
row never drafted as the winner (the gate rested: drafting there is exploration only):

- drafting and capture steps a run, and the gate's reasons counted in them (probe, explore, class, measure);
- excess: the drafting (capture) steps' ms over as many plain steps of the same run, as % of the row's wall;
- gain: the drafting steps' tokens beyond a plain step's, priced at the run's plain ms per token, as %;
- net: excess of both kinds less the gain: what the exploration cost the row.

It reads only what ``bench speedup`` records (``step_kinds``, ``gate_drafted_by``, ``wall_s``); nothing
is timed here.
"""
from __future__ import annotations

from collections import defaultdict

from bench.speedup_pool import each_run_pairs, row_tool_main, step_kind

REASONS = ("probe", "explore", "class", "measure")


def run_cost(run: dict) -> dict | None:
    """One repeat of the row, priced against its own plain steps; None without plain steps to price by."""
    p_steps, p_ms, p_tok = step_kind(run, "plain")
    if not p_steps or not p_tok:
        return None
    d_steps, d_ms, d_tok = step_kind(run, "draft")
    c_steps, c_ms, _ = step_kind(run, "capture")
    plain_ms, per_token_ms = p_ms / p_steps, p_ms / p_tok
    reasons = run.get("gate_drafted_by", {})
    return {"wall_ms": 1e3 * run["wall_s"], "draft_steps": d_steps, "capture_steps": c_steps,
            "draft_excess_ms": d_ms - d_steps * plain_ms, "capture_excess_ms": c_ms - c_steps * plain_ms,
            "gain_ms": (d_tok - d_steps * p_tok / p_steps) * per_token_ms,
            **{r: reasons.get(r, 0) for r in REASONS}}


def by_level(runs: list[dict], row: str) -> dict[int, dict]:
    """Concurrency -> the summed costs of every repeat of its resting cells over all ``runs`` (cells: how
    many, a cell of each run counted apart). Runs are read one by one, so runs of different tables (session
    30's CQ, every load, and CR, c = 16 and 32 only) pool over the loads they share."""
    out: dict[int, dict] = defaultdict(lambda: defaultdict(float))
    for _workload, level, pairs in each_run_pairs(runs, row):
        repeats = [r for _base, r in pairs]
        if any(r.get("gate_drafted_by", {}).get("winner", 0) for r in repeats):
            continue                      # the gate drafted as the winner: not a resting cell
        costs = [c for c in map(run_cost, repeats) if c is not None]
        if not costs:
            continue
        acc = out[int(level)]
        acc["cells"] += 1
        acc["repeats"] += len(costs)
        for c in costs:
            for key, value in c.items():
                acc[key] += value
    return dict(sorted(out.items()))


def table(levels: dict[int, dict], row: str) -> str:
    if not levels:
        return f"No resting cell of {row} (every cell drafted as the winner, or no plain steps)."
    lines = ["| c | resting cells | repeats | drafting steps/run | of them probe / explore / class / measure "
             "| capture steps/run | drafting excess | drafting gain | capture excess | net |", "|---" * 10 + "|"]
    for level, a in levels.items():
        n, pct = a["repeats"], lambda key: 100 * a[key] / a["wall_ms"]      # noqa: E731
        net = 100 * (a["draft_excess_ms"] + a["capture_excess_ms"] - a["gain_ms"]) / a["wall_ms"]
        lines.append(f"| {level} | {int(a['cells'])} | {int(n)} | {a['draft_steps'] / n:.2f} | "
                     + " / ".join(f"{a[r] / n:.2f}" for r in REASONS)
                     + f" | {a['capture_steps'] / n:.2f} | {pct('draft_excess_ms'):.2f}% | {pct('gain_ms'):.2f}% | "
                       f"{pct('capture_excess_ms'):.2f}% | {net:.2f}% |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    return row_tool_main("python -m bench.exploration_cost", __doc__.splitlines()[0],
                         lambda runs, row: table(by_level(runs, row), row), argv, "the gated row (default dspark)")


if __name__ == "__main__":
    raise SystemExit(main())
