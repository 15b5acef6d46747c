"""Where a row's time went against `none`, cell by cell: prompt steps against decode steps.

    python -m bench.step_split docs/results/gpu/s28/runCJ/speedup.json.gz

Why: in a closed loop whose requests all ask for the same number of tokens, `none` keeps them in lockstep:
they finish at the same step, and their successors' prompts share a few prompt steps. Drafting spreads the
finishing steps (each request accepts its own number of tokens), so the successors arrive one or two at a
time and each arrival costs a prompt step of its own. On the H200 a prompt step costs ~3 plain steps at any
number of prompts (session 28, run CJ, extraction c = 16: 6.5 ms with 1.6 prompts, 7.2 ms with 4, against
2.3 ms for a plain step), so the row pays for prompt steps it did not need before. The spec gate compares
decode steps only (``SpecGate.observe``), so it cannot see this cost, and a cell whose drafting steps tie
plain ones loses the whole of it. This prints, per cell, the median over repeats (each row repeat against
`none`'s run of the same repeat) of:

- the throughput ratio (`none`'s wall time over the row's: both serve the same tokens);
- the prompt steps per run of both, and the row's extra milliseconds in prompt steps and in decode steps
  (draft, capture and plain), and outside steps (wall time no step kind holds);
- the decode rate ratio: the row's tokens per millisecond of decode steps over `none`'s;
- the ratio at `none`'s prompt steps: the row's wall time with its prompt steps' time replaced by `none`'s,
  and the extra tokens its prompt steps emitted (decoders beside the prompts emit one each there) produced by
  its decode steps at its own decode rate instead. A what-if, not a measurement: it says how much of the gap
  the extra prompt steps explain, and what is left is the decode steps' own rate.

It reads only what ``bench speedup`` records; nothing is timed here.
"""
from __future__ import annotations

import statistics

from bench.speedup_pool import BASELINE, PoolError, repeat_pairs, row_tool_main, step_kind

DECODE_KINDS = ("draft", "capture", "plain")


def split(base: dict, run: dict) -> dict:
    """One repeat of a row against `none`'s run of the same repeat."""
    if "step_kinds" not in base or "step_kinds" not in run:
        raise PoolError("a run without step_kinds: bench speedup records them since session 17")
    b_prompt, r_prompt = step_kind(base, "prompt"), step_kind(run, "prompt")
    b_dec = [step_kind(base, k) for k in DECODE_KINDS]
    r_dec = [step_kind(run, k) for k in DECODE_KINDS]
    b_dec_ms, r_dec_ms = sum(k[1] for k in b_dec), sum(k[1] for k in r_dec)
    b_dec_tok, r_dec_tok = sum(k[2] for k in b_dec), sum(k[2] for k in r_dec)
    b_wall, r_wall = 1000 * base["wall_s"], 1000 * run["wall_s"]
    # the what-if: the row's prompt steps cost what `none`'s did, and the decode tokens its extra prompt steps
    # emitted come from its decode steps at its own decode rate instead
    r_rate = r_dec_tok / r_dec_ms if r_dec_ms and r_dec_tok else None
    at_base = None if r_rate is None else (r_wall - r_prompt[1] + b_prompt[1] + (r_prompt[2] - b_prompt[2]) / r_rate)
    return {
        "ratio": b_wall / r_wall,
        "prompt_steps": (b_prompt[0], r_prompt[0]),
        "prompt_ms": r_prompt[1] - b_prompt[1],
        "decode_ms": r_dec_ms - b_dec_ms,
        "outside_ms": (r_wall - r_prompt[1] - r_dec_ms) - (b_wall - b_prompt[1] - b_dec_ms),
        "decode_rate_ratio": r_rate / (b_dec_tok / b_dec_ms) if r_rate and b_dec_ms and b_dec_tok else None,
        "ratio_at_base_prompts": None if at_base is None else b_wall / at_base,
        "drafted": sum(run.get("gate_drafted_by", {}).values()),
    }


def cell_splits(runs: list[dict], row: str) -> list[tuple[str, int, list[dict]]]:
    """(workload, concurrency, the splits of every repeat of every run) for each cell."""
    return [(workload, int(level), [split(b, x) for b, x in pairs])
            for workload, level, pairs in repeat_pairs(runs, row)]


def _med(splits: list[dict], key: str) -> float | None:
    vals = [s[key] for s in splits if s[key] is not None]
    return statistics.median(vals) if vals else None


def _fmt(x: float | None, spec: str) -> str:
    return "-" if x is None else format(x, spec)


def table(by_cell: list[tuple[str, int, list[dict]]], row: str) -> str:
    lines = [f"| workload | c | repeats | drafted steps/run | throughput {row} / {BASELINE} | prompt steps "
             f"{BASELINE} → {row} | +ms prompt steps | +ms decode steps | +ms outside | decode rate ratio | "
             f"ratio at {BASELINE}'s prompt steps |",
             "|---" * 11 + "|"]
    for workload, level, s in by_cell:
        b_n = statistics.median(x["prompt_steps"][0] for x in s)
        r_n = statistics.median(x["prompt_steps"][1] for x in s)
        lines.append(f"| {workload} | {level} | {len(s)} | {statistics.fmean(x['drafted'] for x in s):.1f} | "
                     f"{_med(s, 'ratio'):.3f} | {b_n:g} → {r_n:g} | {_fmt(_med(s, 'prompt_ms'), '+.1f')} | "
                     f"{_fmt(_med(s, 'decode_ms'), '+.1f')} | {_fmt(_med(s, 'outside_ms'), '+.1f')} | "
                     f"{_fmt(_med(s, 'decode_rate_ratio'), '.3f')} | {_fmt(_med(s, 'ratio_at_base_prompts'), '.3f')} |")
    return "\n".join(lines)


def step_costs(runs: list[dict], row: str) -> str:
    """``--step-costs``: what `none`'s runs are made of, cell by cell (medians over the repeats): prompt and
    plain steps per run, milliseconds a step of each, and the prompt steps' share of the wall. Why: where
    prompt steps hold most of a run (c = 32, 48-token answers), a drafter can act on the rest only, and
    each extra prompt step its requests cause costs a few plain steps (docs/results/speedup.md, session 42)."""
    lines = [f"| workload | c | repeats | {BASELINE} prompt steps/run | ms a prompt step | plain steps/run | "
             "ms a plain step | prompt steps' share of the wall |", "|---" * 8 + "|"]
    for workload, level, pairs in repeat_pairs(runs, row):
        cols = []
        for base, _run in pairs:
            (pn, pms, _), (dn, dms, _) = step_kind(base, "prompt"), step_kind(base, "plain")
            cols.append((pn, pms / pn if pn else None, dn, dms / dn if dn else None, pms / (1000 * base["wall_s"])))
        med = [statistics.median(v for v in col if v is not None) if any(v is not None for v in col) else None
               for col in zip(*cols)]
        lines.append(f"| {workload} | {level} | {len(cols)} | {med[0]:g} | {_fmt(med[1], '.2f')} | {med[2]:g} | "
                     f"{_fmt(med[3], '.2f')} | {med[4]:.0%} |")
    return "\n".join(lines)


PHASES = ("schedule", "forward")


def kind_phases(run: dict, kinds: tuple[str, ...]) -> tuple[float, float, float] | None:
    """ms a step of ``kinds`` (pooled) in the schedule phase, the forward phase and the rest of the step, in
    one timed run; None where it ran none of them."""
    seen = [k for name, k in run.get("step_kinds", {}).items() if name in kinds]
    steps = sum(k["steps"] for k in seen)
    if not steps:
        return None
    if any(f"{phase}_ms" not in k for k in seen for phase in PHASES):
        raise PoolError("a run without each step kind's phases: bench speedup records them since session 45")
    schedule, forward = (sum(k[f"{phase}_ms"] for k in seen) / steps for phase in PHASES)
    return schedule, forward, sum(k["ms"] for k in seen) / steps - schedule - forward


def phases(runs: list[dict], row: str) -> str:
    """``--phases``: prompt steps and decode steps (draft, capture and plain pooled) cell by cell, ms a step
    in the schedule phase (admission, kvd, the gate, drafting), the forward phase (the model, sampling and
    verification) and the rest of the step, `none` → the row (medians over the repeats). Why: on the H100
    (session 45, run DW) scheduled dspark rested through knowledge at c = 32 and its prompt steps still took
    0.2-0.3 ms more than `none`'s; the whole-run phase averages mixed prompt and decode steps."""
    head = [f"{kind} {phase}" for kind in ("prompt", "decode") for phase in (*PHASES, "rest")]
    lines = [f"| workload | c | repeats | " + " | ".join(f"{h}, {BASELINE} → {row}" for h in head) + " |",
             "|---" * (3 + len(head)) + "|"]
    for workload, level, pairs in repeat_pairs(runs, row):
        cols = []
        for kinds in (("prompt",), DECODE_KINDS):
            got = [(kind_phases(b, kinds), kind_phases(r, kinds)) for b, r in pairs]
            got = [(b, r) for b, r in got if b is not None and r is not None]
            for i in range(3):
                cols.append("-" if not got else f"{statistics.median(b[i] for b, _ in got):.3f} → "
                                                f"{statistics.median(r[i] for _, r in got):.3f}")
        lines.append(f"| {workload} | {level} | {len(pairs)} | " + " | ".join(cols) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    return row_tool_main("python -m bench.step_split", __doc__.splitlines()[0],
                         lambda runs, row: table(cell_splits(runs, row), row), argv, "the row to split against none (default dspark)",
                         other=[("--step-costs", "print what none's runs are made of instead: prompt and plain steps "
                                 "per run, ms a step of each, the prompt steps' share of the wall", step_costs),
                                ("--phases", "print prompt and decode steps' ms a step by phase instead (schedule, "
                                 "forward, the rest), none -> the row (runs since session 45)", phases)])


if __name__ == "__main__":
    raise SystemExit(main())
