"""What a drafting step costs against a plain step, cell by cell, from `bench speedup` results.

    python -m bench.draft_step_cost docs/results/gpu/s29/runCK/speedup.json.gz

Why: speculation pays where the tokens a drafting step emits outnumber its cost in plain steps. On the H200
a drafting step of the 0.5B target with its one-layer DSpark drafter cost ~1.9 plain steps at c = 1 (session
29, run CK, extraction: 3.38 against 1.77 ms), so a request that accepts ~2.4 tokens a step only breaks
even, and the gate drafts near a tie. Changes that cut the drafting step's own cost (the context projection
from graphs, session 29) show here first, in milliseconds, before they are large enough to move a cell's
throughput ratio out of the noise. This prints, per cell, medians over the row's repeats that drafted:

- ms per drafting step (step kind ``draft``) and ms per plain step of `none`'s run of the same repeat;
- their ratio (the drafting step in plain steps) and the tokens a drafting step emitted (every request of
  the step together, over `none`'s tokens per plain step: the same batch emits one each there);
- the break-even: the cost ratio over the token ratio (below 1, drafting steps are faster per token).

It reads only what ``bench speedup`` records (``step_kinds``); nothing is timed here.
"""
from __future__ import annotations

import statistics

from bench.speedup_pool import BASELINE, repeat_pairs, row_tool_main, step_kind


def cost(base: dict, run: dict) -> dict | None:
    """One repeat: the row's drafting steps against `none`'s plain steps; None if it did not draft."""
    d_steps, d_ms, d_tok = step_kind(run, "draft")
    p_steps, p_ms, p_tok = step_kind(base, "plain")
    if not d_steps or not p_steps or not p_tok:
        return None
    step_ratio = (d_ms / d_steps) / (p_ms / p_steps)
    token_ratio = (d_tok / d_steps) / (p_tok / p_steps)
    return {"steps": d_steps, "draft_ms": d_ms / d_steps, "plain_ms": p_ms / p_steps, "step_ratio": step_ratio,
            "token_ratio": token_ratio, "per_token": step_ratio / token_ratio}


def cell_costs(runs: list[dict], row: str) -> list[tuple[str, int, list[dict]]]:
    """(workload, concurrency, the costs of the repeats that drafted) for each cell where any did."""
    out = []
    for workload, level, pairs in repeat_pairs(runs, row):
        got = [c for c in (cost(b, r) for b, r in pairs) if c is not None]
        if got:
            out.append((workload, int(level), got))
    return out


def table(by_cell: list[tuple[str, int, list[dict]]], row: str) -> str:
    lines = [f"| workload | c | repeats that drafted | drafting steps/run | ms a drafting step | ms a {BASELINE} "
             f"plain step | drafting step in plain steps | tokens a drafting step, in plain steps' | cost a "
             f"token against plain |", "|---" * 9 + "|"]
    if not by_cell:
        return f"No repeat of {row} drafted a step."
    for workload, level, s in by_cell:
        med = lambda key: statistics.median(x[key] for x in s)     # noqa: E731
        lines.append(f"| {workload} | {level} | {len(s)} | {statistics.fmean(x['steps'] for x in s):.1f} | "
                     f"{med('draft_ms'):.2f} | {med('plain_ms'):.2f} | {med('step_ratio'):.2f} | "
                     f"{med('token_ratio'):.2f} | {med('per_token'):.2f} |")
    return "\n".join(lines)


PHASES = ("draft_first", "draft_later")


def phases(runs: list[dict], row: str) -> str:
    """``--phases``: the drafting steps that open a drafting phase (a probe's, an exploration's, a switch
    to the winner) against the phase's later ones, cell by cell, over every repeat that drafted: steps a
    run, and ms a step with its schedule (the proposal) and forward (the verify pass) parts. From the
    runs' ``draft_phases`` (``bench speedup`` records them since session 42). Why: at c = 32 a probe's
    steps cost 10-27 ms on the H200 against 7-8 ms in a drafting phase (session 40), unexplained."""
    head = " | ".join(f"{p} steps/run | ms a step (schedule [gate, propose] + forward)" for p in PHASES)
    lines = [f"| workload | c | repeats that drafted | {head} |", "|---" * (3 + 2 * len(PHASES)) + "|"]
    for workload, level, pairs in repeat_pairs(runs, row):
        drafted = [r["draft_phases"] for _, r in pairs if r.get("draft_phases")]
        if not drafted:
            continue
        cols = []
        for phase in PHASES:
            got = [d[phase] for d in drafted if phase in d]
            n = sum(g["steps"] for g in got)
            if not n:
                cols += ["0", "-"]
                continue
            ms, sched, gate, prop, fwd = (sum(g.get(k, 0.0) for g in got) / n
                                          for k in ("ms", "schedule_ms", "gate_ms", "propose_ms", "forward_ms"))
            # records before the split (session 42's runs) have no gate_ms / propose_ms: "-", not a zero
            split = f"{gate:.2f}, {prop:.2f}" if all("gate_ms" in g for g in got) else "-"
            cols += [f"{n / len(drafted):.1f}", f"{ms:.2f} ({sched:.2f} [{split}] + {fwd:.2f})"]
        lines.append(f"| {workload} | {level} | {len(drafted)} | " + " | ".join(cols) + " |")
    if len(lines) == 2:
        return f"No repeat of {row} recorded draft_phases (bench speedup since session 42) with a drafting step."
    return "\n".join(lines)


KINDS = ("plain", "capture", "draft")


def kinds(runs: list[dict], row: str) -> str:
    """``--kinds``: per cell, the row's plain, capture and drafting steps against `none`'s plain steps, each
    as ms a step split into schedule (gate, proposal), forward and the rest after the step's sync (output,
    features, commit), over every repeat that took such a step. Why: the part after the sync is host time
    the GPU waits through; a capture step cost ~0.2 ms over a plain one there (H100, session 47, run FA),
    and session 48 moved the features' fuse into the forward's shadow (``SpecEngine._fuse_features``):
    the `-fuse-late` rows run the old path beside it."""
    def split(got: list[dict]) -> str:
        n = sum(g["steps"] for g in got)
        if not n:
            return "-"
        ms, sched, fwd = (sum(g.get(k, 0.0) for g in got) / n for k in ("ms", "schedule_ms", "forward_ms"))
        return f"{ms:.2f} ({sched:.2f} + {fwd:.2f} + {ms - sched - fwd:.2f})"

    head = " | ".join(f"{row} {k}" for k in KINDS)
    lines = [f"| workload | c | {BASELINE} plain | {head} |", "|---" * (3 + len(KINDS)) + "|",
             "| | | ms a step (schedule + forward + after the sync) | | | |"]
    for workload, level, pairs in repeat_pairs(runs, row):
        base = [b.get("step_kinds", {}).get("plain") for b, _ in pairs]
        cols = [split([b for b in base if b])]
        for kind in KINDS:
            cols.append(split([k for k in (r.get("step_kinds", {}).get(kind) for _, r in pairs) if k]))
        lines.append(f"| {workload} | {level} | " + " | ".join(cols) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    return row_tool_main("python -m bench.draft_step_cost", __doc__.splitlines()[0],
                         lambda runs, row: table(cell_costs(runs, row), row), argv, "the drafting row (default dspark)",
                         other=[("--phases", "print a drafting phase's first steps against its later ones instead "
                                 "(ms a step, schedule and forward apart)", phases),
                                ("--kinds", "print the row's plain, capture and drafting steps against none's plain "
                                 "steps instead: ms a step, schedule + forward + after the sync", kinds)])


if __name__ == "__main__":
    raise SystemExit(main())
