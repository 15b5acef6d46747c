"""One gate cell's recorded reports from `bench speedup` results, as a table, with the drafting step time its
predictions imply.

    python -m bench.gate_trace docs/results/gpu/s45/runDV/speedup/speedup.json.gz --cell dspark_b4
    python -m bench.gate_trace RESULT --cell dspark_b4 --at extraction.eval:4 [--row ngram-gated]
    python -m bench.gate_trace RESULT --prices [--against dspark-g7] [--row dspark-capture-prompts]
    python -m bench.gate_trace RESULT --calibration [--row dspark-markov-ref]
    python -m bench.gate_trace RESULT --replay-calibration [--row R]
    python -m bench.gate_trace RESULT --phase-steps [--row R]
    python -m bench.gate_trace RESULT --replay-steady [--row R]
    python -m bench.gate_trace RESULT --phase-tokens [--lasting 6] [--row R]
    python -m bench.gate_trace RESULT --replay-class [--class-prior long|probes] [--row R]
    python -m bench.gate_trace RESULT --reasons [--against dspark-g7] [--row R]

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

from bench.arg_types import positive_int
from bench.probe_cut import ACCEPTANCE, DRAFTED, MS, PLAIN, PREDICTED, REASON, SEQUENCES, TOKENS, USED
from bench.speedup_pool import PoolError, load


def latest(cell: dict, row: str | None = None) -> dict:
    """A (workload, concurrency) cell's latest reports by gate cell: the engine's gate's (``gate_recent``), or
    with ``row`` that row's own gate's (``gate_recent_by_row``); {} when the result has none."""
    traces = cell.get("gate_recent") if row is None else cell.get("gate_recent_by_row", {}).get(row)
    return traces or {}


def own_gates(result: dict, row: str) -> None:
    """Refuse ``row`` unless some cell of ``result`` kept reports of its own gate: a row that runs on the
    engine's gate (the default ``dspark`` among them) has its reports without ``--row``, and reading them under
    its name found nothing and said only that no step qualified (session 55)."""
    rows = sorted({r for levels in result.get("workloads", {}).values() for cell in levels.values()
                   for r in cell.get("gate_recent_by_row", {})})
    if row not in rows:
        raise PoolError(f"row {row!r} ran no gate of its own in this run (rows that did: {', '.join(rows) or 'none'}); "
                        "the engine's gate's reports, the default row's among them, are read without --row")


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
        traces = latest(got, row)
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


def prices(result: dict, against: str = "dspark-g7", row: str | None = None, key: str = "dspark") -> list[dict]:
    """For every (workload, concurrency) cell of a run: the latest reports of gate key ``key``'s cell at that
    load (the engine's gate; ``row``: that row's own) that carry a prediction, as how many of them drafted
    and their median predicted tokens a sequence and implied drafting step; beside them what ``against`` (a
    fixed-γ row of the same drafter) measured there: its median drafting step (the median over its runs of
    each run's mean, ``step_kinds``), its τ, and both rows' p50 throughput ratios. Medians, not the last
    report: the last one is a run's final step, where the last requests' predictions are capped by what
    they have left to emit (``SpecGate._acceptance``'s ``caps``; session 47, EC coding c = 1: 1.67-1.79
    tokens, then 1.00 at the end).

    Why: a cell rests when its predicted acceptance times its drafting price loses to plain decoding, and in a
    resting cell the price comes from its probes (with held capture charges). Read cell by cell beside what
    fixed γ measured, it shows which of the two kept a cell resting where drafting won (session 47: the
    acceptance in 13 of 14 such cells of runs DV-FA, the price in the capture row). Only the reports new
    since the cell run before (``new_reports``): with ``--gate-trace-steps 4096`` (session 50 on) a cell's
    window holds the workloads before it too, whose medians it reported until session 53. Reads records
    only."""
    from statistics import median

    out = []
    for workload, level, cell, _, fresh in fresh_cells(result, row, key):
        decided = [(r, ms) for r in fresh if (ms := implied_step_ms(r)) is not None]
        rows = cell.get("rows", {})
        if not decided or against not in rows:
            continue
        steps = [run["step_kinds"]["draft"]["ms"] / run["step_kinds"]["draft"]["steps"]
                 for run in rows[against]["runs"] if run.get("step_kinds", {}).get("draft", {}).get("steps")]
        measured = median(steps) if steps else None
        implied = median(ms for _, ms in decided)
        scheduled = rows.get(row or key, {}).get("throughput_ratio", {})
        out.append({"workload": workload, "concurrency": level,
                    "drafted": sum(bool(r[DRAFTED]) for r, _ in decided), "reports": len(decided),
                    "predicted_tokens": median(r[ACCEPTANCE] for r, _ in decided), "implied_ms": implied,
                    "against_ms": measured, "over": None if not measured else implied / measured,
                    "against_tau": rows[against].get("tau"),
                    "ratio": scheduled.get("p50"), "against_ratio": rows[against].get("throughput_ratio", {}).get("p50")})
    return out


REASONS = ("explore", "class", "probe", "winner")


def reasons(result: dict, against: str = "dspark-g7", row: str | None = None, key: str = "dspark") -> list[dict]:
    """For every (workload, concurrency) cell of a run: the tokens a sequence its gate's drafting steps emitted
    by why they drafted (``REASONS``: exploring, a class exploring, a probe, the predicted winner), as
    (tokens / sequences, steps), beside the τ ``against`` (a fixed-γ row, which drafts every step) measured
    in the same cell. Warm-ups are left out.

    Why: the gate learns acceptance from the steps it drafts, and the winner's steps are chosen by a
    prediction, so they run high (selection). A fixed-γ row drafts every step, and a probe drafts when its
    wait ends, not because a prediction chose it. Session 55 (H100, run MA; ``--against dspark-g7``):
    knowledge c = 1 winner steps 3.17 a sequence, probes 1.44, fixed γ = 7 τ 1.57; creative c = 1 1.58,
    1.27 and 1.25; support c = 1 2.36, 1.94 and 2.43 (its probes open phases, whose first steps emit ~10%
    fewer tokens there, ``phase_tokens``). So a record fed by the winner's steps rates a class above what
    drafting it would emit, where the gate drafts only in its good stretches. Reads records only."""
    out = []
    for workload, level, cell, _, fresh in fresh_cells(result, row, key):
        by: dict[str, list] = {}
        for r in fresh:
            if r[DRAFTED] and r[USED] and r[SEQUENCES]:
                tally(by, r[REASON], r)
        if by:
            out.append({"workload": workload, "concurrency": level, "reasons": per_sequence(by),
                        "against_tau": cell.get("rows", {}).get(against, {}).get("tau")})
    return out


def tally(by: dict, key, report: list) -> None:
    """Add ``report``'s emitted tokens and sequences, and one step, to ``by[key]`` ([tokens, sequences, steps])."""
    got = by.setdefault(key, [0, 0, 0])
    got[0] += report[TOKENS]
    got[1] += report[SEQUENCES]
    got[2] += 1


def per_sequence(by: dict) -> dict:
    """``tally``'s sums as {key: (tokens a sequence, steps)}, in key order."""
    return {key: (tokens / sequences, steps) for key, (tokens, sequences, steps) in sorted(by.items())}


def counted(got: tuple | None) -> str:
    """A table cell for a (value, how many) pair: the value to 2 places and the count; '-' for none."""
    return "-" if got is None else f"{got[0]:.2f} ({got[1]})"


def reasons_table(entries: list[dict], against: str) -> str:
    return markdown(["workload", "c"] + [f"{reason} tok/seq (steps)" for reason in REASONS] + [f"{against} τ"],
                    [[e["workload"], e["concurrency"]] + [counted(e["reasons"].get(reason)) for reason in REASONS]
                     + ["-" if e["against_tau"] is None else f"{e['against_tau']:.2f}"] for e in entries])


def new_reports(previous: list[list], current: list[list]) -> list[list]:
    """The reports of ``current`` (a cell's latest reports, a window of at most the gate's ``trace_steps``)
    that ``previous`` (the same cell's window after the cell run before) does not hold: the window slid by
    the smallest shift that lines the two up. All of ``current`` when nothing lines up (a window slid past
    everything ``previous`` held)."""
    for shift in range(len(previous) + 1):
        kept = previous[shift:]
        if current[:len(kept)] == kept:
            return current[len(kept):]
    return current


def fresh_cells(result: dict, row: str | None = None, key: str = "dspark"):
    """Every (workload, concurrency) cell of a run in record order, as (workload, concurrency, the cell's
    entry, the gate cell's name at that load, its reports new since the cell run before, ``new_reports``):
    with ``--gate-trace-steps 4096`` a cell's window holds the workloads run before it too. The views below
    (``prices``, ``calibration``, ``replay_calibration``, ``phase_steps``) each read a run this way."""
    from specd.engine.spec_gate import load_bucket

    seen: dict[str, list] = {}
    for workload, levels in result.get("workloads", {}).items():
        for level, entry in levels.items():
            name = f"{key}_b{load_bucket(int(level))}"
            window = latest(entry, row).get(name, [])
            fresh, seen[name] = new_reports(seen.get(name, []), window), window
            yield workload, int(level), entry, name, fresh


def calibration(result: dict, row: str | None = None, key: str = "dspark") -> list[dict]:
    """For every (workload, concurrency) cell of a run: the drafting steps that the gate cell at that load
    (the engine's gate; ``row``: that row's own) decided on a prediction in that cell, as predicted tokens a
    sequence against the tokens a sequence each step emitted (all the batch's sequences, as the prediction
    counts them); means, and their ratio (at c = 1 a step emits a whole number of tokens, so a median
    says little). Probes count: they are the steps a resting
    cell's prediction is measured by. Only the reports new since the cell run before (``new_reports``).

    Why: the gate drafts where its predicted acceptance times its drafting price beats plain decoding, and
    in session 52's run JB support at c = 32 drafted 21 steps a run predicted at 2.8-3.6 tokens a sequence
    that emitted 1.0-2.5, 0.96x `none`: the requests' records carried the acceptance of lighter loads. This
    says, cell by cell, how far off the predictions of the steps that drafted were. Reads records only."""
    out = []
    for workload, level, _, _, fresh in fresh_cells(result, row, key):
        steps = [(r[ACCEPTANCE], r[TOKENS] / r[SEQUENCES]) for r in fresh
                 if r[DRAFTED] and r[USED] and r[ACCEPTANCE] is not None and r[SEQUENCES]]
        if not steps:
            continue
        predicted, emitted = sum(p for p, _ in steps), sum(e for _, e in steps)
        out.append({"workload": workload, "concurrency": level, "drafted": len(steps),
                    "predicted": predicted / len(steps), "emitted": emitted / len(steps),
                    "emitted_over_predicted": emitted / predicted if predicted > 0 else None})
    return out


def replay_calibration(result: dict, row: str | None = None, key: str = "dspark") -> list[dict]:
    """What a calibrated gate (``Cell.calibration``, session 53) would have made of the drafting steps in a
    run's records that an uncalibrated gate drafted as the winner: per (workload, concurrency) cell, those
    steps, and how many of them the calibration factor (from the same gate cell's earlier drafting steps
    decided on a prediction, in record order) would have turned to rests (their predicted drafting rate
    times the factor no longer beats plain decoding by ``MARGIN``); and the factor after the cell.

    A counterfactual from the records, not a replay of the gate: a step turned to a rest would not have
    drafted, so the later factor, rates and records would all differ. Why have it: it says before a GPU
    run where the calibration would bite (session 52's JB: 23 of support c = 32's 28 winner drafting steps)
    and where it would cost drafting that paid. Probes are counted apart: they draft whatever the factor."""
    from specd.engine.spec_gate import MARGIN, Cell

    out, cells = [], {}
    for workload, level, _, name, fresh in fresh_cells(result, row, key):
        gate_cell = cells.setdefault(name, Cell())
        kept = rested = other = 0
        for r in fresh:
            if not (r[DRAFTED] and r[USED]) or r[ACCEPTANCE] is None or not r[SEQUENCES]:
                continue
            if r[REASON] == "winner":
                if r[PREDICTED] * gate_cell.calibration > r[PLAIN] * (1.0 + MARGIN):
                    kept += 1
                else:
                    rested += 1
            else:
                other += 1
            gate_cell.calibrate(r[TOKENS] / r[SEQUENCES], r[ACCEPTANCE])
        if kept or rested or other:
            out.append({"workload": workload, "concurrency": level, "winner_steps": kept + rested,
                        "would_rest": rested, "probes": other, "factor": gate_cell.calibration})
    return out


def phase_places(reports: list[list], at: int = 0):
    """Each report with its place in its drafting phase as the gate counts it (``Cell.phase_at``): the
    drafting steps since the last rest, this one included; 0 for a rest. ``at``: the place before the first."""
    for r in reports:
        at = at + 1 if r[DRAFTED] else 0
        yield r, at


def replay_steady(result: dict, row: str | None = None, key: str = "dspark") -> list[dict]:
    """What a steady-priced gate (``SpecGate.steady_price``, session 54) would have made of the steps in a
    run's records that the gate rested as the winner on a prediction: per (workload, concurrency) cell, those
    rests, and how many would have drafted: their predicted drafting rate scaled by the steady-priced
    drafting arm over the arm as measured (both rebuilt from the same gate cell's reports in record order,
    ``Cell.time_phase``) beats plain decoding by ``MARGIN``; and the cell's opening ratio after the cell.

    A counterfactual from the records, as ``replay_calibration`` is: a rest turned to drafting would have
    started a phase, and everything after it would differ; the capture charges (``SpecGate.charge``) are
    not in the reports and are left out of both arms. Read it on a gate that priced drafting as measured:
    the default before session 54, since then ``--row dspark-opening-priced`` (a steady-priced gate's
    recorded predictions already carry the ratio). Why have it: it says before a GPU run where the rule
    would bite, and whether it would bite only where fixed γ = 7 won (``--prices``). Session 54: on session
    53's KA it named support c = 4 (383 of 548 rests); on LB's old rule extraction c = 16 (220 of 985), where
    the steady-priced row then ran 1.37x `none` against 0.99x."""
    from specd.engine.spec_gate import DECAY, MARGIN, Cell

    out, cells = [], {}
    for workload, level, _, name, fresh in fresh_cells(result, row, key):
        measured, steady = cells.setdefault(name, (Cell(), Cell()))
        rests = drafts = 0
        for r, at in phase_places(fresh, measured.phase_at):
            measured.phase_at = steady.phase_at = at
            if not r[USED] or not r[SEQUENCES]:
                continue
            if (not r[DRAFTED] and r[REASON] == "winner" and r[ACCEPTANCE] is not None and r[PREDICTED]
                    and measured.draft.per_seq_s > 0):
                rests += 1
                drafts += r[PREDICTED] * steady.draft.per_seq_s / measured.draft.per_seq_s > r[PLAIN] * (1.0 + MARGIN)
            for c in (measured, steady):
                c.draft.age(DECAY)
                c.plain.age(DECAY)
            seconds = r[MS] / 1e3
            if r[DRAFTED]:
                measured.time_phase(seconds)
                measured.draft.add(r[TOKENS], seconds, r[SEQUENCES])
                steady.draft.add(r[TOKENS], steady.time_phase(seconds), r[SEQUENCES])
        if rests:
            out.append({"workload": workload, "concurrency": level, "winner_rests": rests, "would_draft": drafts,
                        "opening": steady.opening})
    return out


def replay_class(result: dict, row: str | None = None, key: str = "dspark", prior: str = "long",
                 decay: float = 0.995) -> list[dict]:
    """What a gate whose requests start from another class record would have made of the steps its gate
    decided as the winner on a prediction: per (workload, concurrency) cell, the rests and how many would
    have drafted, the drafting steps and how many would have rested, and the two class records after the
    cell. ``prior``: "long", the class remembering ``decay`` of its older drafting steps instead of
    ``CLASS_DECAY`` (``SpecGate.class_decay``, the dspark-class-long row); "probes", a record of the class's
    probe steps only, shrunk toward the default start by ``PRIOR_STEPS`` (not built: probes draft when
    their wait ends, not when a prediction chose them, ``reasons``). One class a workload (the bench's
    prompts open with their workload's system turn); the records learn every drafting step in the reports,
    each sequence at the step's mean; the cell's drafting acceptance (the start's own prior) from the same
    reports, as ``replay_steady`` rebuilds it. A step moves by the two starts' difference, and drafts when
    its predicted drafting rate, scaled by that, beats plain decoding by ``MARGIN``.

    An upper bound on what moves, and a counterfactual like ``replay_steady``: the whole prediction moves,
    as if each request's own record had drifted all the way back to its start (``RESTING_DECAY``); classes
    are per workload; steps the cell did not report (a class's exploring steps) are missing; and a changed
    decision would change everything after it. Session 55 (runs MA, MC, ME): "long" drafts most of support
    c = 1's rests (312 of 412 in MA), but also creative c = 1's (2,404 of 3,020 in MC) and knowledge
    c = 1's (410 of 412 in ME), where fixed γ = 7 ran 0.82 and 0.97x `none`; "probes" rests most of support
    c = 4-8's drafting steps in ME (230 of 332, 273 of 292) and extraction's (a class with one probe)."""
    from specd.engine.gate_records import CLASS_DECAY, ClassRecord
    from specd.engine.spec_gate import DECAY, MARGIN, PRIOR_STEPS, Cell

    if prior not in ("long", "probes"):
        raise PoolError(f"unknown class prior {prior!r}: long or probes")
    k = PRIOR_STEPS
    out, classes, cells = [], {}, {}
    for workload, level, _, name, fresh in fresh_cells(result, row, key):
        default, other = classes.setdefault(workload, (ClassRecord(), ClassRecord(
            decay=decay if prior == "long" else CLASS_DECAY)))
        cell = cells.setdefault(name, Cell())
        rests = drafts = drafted = rested = 0
        for r in fresh:
            if not r[USED] or not r[SEQUENCES]:
                continue
            own = cell.draft.per_drafter_step
            if r[REASON] == "winner" and r[ACCEPTANCE] and r[PREDICTED] and default.steps and own > 0:
                start = (default.tokens + k * own) / (default.steps + k)
                moved = ((other.tokens + k * own) / (other.steps + k) if prior == "long"
                         else (other.tokens + k * start) / (other.steps + k))
                wins = r[PREDICTED] * (r[ACCEPTANCE] + moved - start) / r[ACCEPTANCE] > r[PLAIN] * (1.0 + MARGIN)
                if r[DRAFTED]:
                    drafted += 1
                    rested += not wins
                else:
                    rests += 1
                    drafts += wins
            cell.draft.age(DECAY)
            if r[DRAFTED]:
                cell.draft.add(r[TOKENS], r[MS] / 1e3, r[SEQUENCES])
                for _ in range(r[SEQUENCES]):
                    default.add(r[TOKENS] / r[SEQUENCES])
                    if prior == "long" or r[REASON] == "probe":
                        other.add(r[TOKENS] / r[SEQUENCES])
        if rests or drafted:
            out.append({"workload": workload, "concurrency": level, "winner_rests": rests, "would_draft": drafts,
                        "winner_drafts": drafted, "would_rest": rested,
                        "class": default.tokens / default.steps if default.steps else None,
                        "other": other.tokens / other.steps if other.steps else None})
    return out


def class_table(entries: list[dict], prior: str = "long") -> str:
    def num(v):
        return "-" if v is None else f"{v:.2f}"

    return markdown(["workload", "c", "rested as the winner", f"would draft ({prior})", "drafted as the winner",
                     f"would rest ({prior})", "class record after", f"{prior} record after"],
                    [[e["workload"], e["concurrency"], e["winner_rests"], e["would_draft"], e["winner_drafts"],
                      e["would_rest"], num(e["class"]), num(e["other"])] for e in entries])


def steady_table(entries: list[dict]) -> str:
    return markdown(["workload", "c", "rested as the winner", "would draft, steady-priced", "opening ratio after"],
                    [[e["workload"], e["concurrency"], e["winner_rests"], e["would_draft"], f"{e['opening']:.2f}"]
                     for e in entries])


def phase_steps(result: dict, row: str | None = None, key: str = "dspark", longest: int = 4) -> list[dict]:
    """Each gate cell's drafting steps in a run's records by where they stand in their drafting phase (the
    steps drafted since the last rest: 1st, 2nd, ..., ``longest``-th and later), over the (workload,
    concurrency) cells in record order: the median ms of a step and how many; samples of a full batch only
    (the cell's concurrency, at least 90% of it: a draining batch's steps are shorter).

    Why: a resting cell's drafting arm is essentially its latest probe, so the price at which it keeps
    resting is what a phase's first steps cost (with the capture time held for them, ``SpecGate.charge``,
    which the reports do not show; the result's ``gate`` stats do, in all). H100, session 53, run KC
    (coding c = 4): the calibrated gate's rests priced a drafting step at 5.96 ms where the other gate
    drafted on at 3.92; by this table the b4 cells' phases open at 4.0-4.7 ms a step and settle at 3.6-3.9
    (KA, KC), and that gate's factor (``Cell.calibration``) lowered the rate further. Reads records only."""
    from statistics import median

    cells = {}
    for _, level, _, name, fresh in fresh_cells(result, row, key):
        for r, at in phase_places(fresh):
            if at and r[USED] and r[SEQUENCES] >= 0.9 * level:
                cells.setdefault(name, {}).setdefault(min(at, longest), []).append(r[MS])
    out = []
    for name, by in sorted(cells.items(), key=lambda kv: int(kv[0].rpartition("_b")[2])):
        out.append({"cell": name, "steps": {at: (median(ms), len(ms)) for at, ms in sorted(by.items())}})
    return out


def drafting_phases(reports: list[list]):
    """Each drafting phase of ``reports`` as its [(place, report)]: the drafting steps from a rest to the next
    rest or to the window's end (so a phase cut by the window counts as long as it was seen)."""
    phase = []
    for r, at in phase_places(reports):
        if at:
            phase.append((at, r))
        elif phase:
            yield phase
            phase = []
    if phase:
        yield phase


def phase_tokens(result: dict, row: str | None = None, key: str = "dspark", longest: int = 4,
                 lasting: int = 6) -> list[dict]:
    """Per workload, the tokens a sequence its drafting steps emitted by their place in their drafting phase
    (1st, 2nd, ..., ``longest``-th and later), twice: over every phase, and over the phases that lasted at
    least ``lasting`` steps only. Each is (tokens / sequences, drafting steps); warm-ups and steps without
    sequences are left out.

    Why both: a phase goes on while its steps win, so the later places hold only the phases that accepted
    well, and over every phase the openings look worse than they are (survivorship). Within phases that
    lasted, the 1st steps' tokens are what opening a phase costs in acceptance. Sessions 54-55 (runs LA, MA,
    MC, ME, one run each): coding's 1st steps emitted 1.72-1.90 tokens a sequence over every phase against
    2.18-2.23 from the 4th on, but 1.85-2.47 within phases of 6 steps or more; support's 1.98-2.27 over
    every phase, 2.50-2.86 within the lasting ones, against 2.79-2.96 later (a ~10% residue). So most of
    the openings' low acceptance in the records is which phases go on, not what an opening costs.
    Reads records only."""
    by: dict[str, dict] = {}
    for workload, _, _, _, fresh in fresh_cells(result, row, key):
        entry = by.setdefault(workload, {"all": {}, "lasting": {}, "phases": 0, "lasted": 0})
        for phase in drafting_phases(fresh):
            lasted = phase[-1][0] >= lasting
            entry["phases"] += 1
            entry["lasted"] += lasted
            for at, r in phase:
                if not (r[USED] and r[SEQUENCES]):
                    continue
                for kind in ("all", "lasting") if lasted else ("all",):
                    tally(entry[kind], min(at, longest), r)
    out = []
    for workload, entry in by.items():
        if not entry["phases"]:
            continue
        out.append({"workload": workload, "phases": entry["phases"], "lasted": entry["lasted"],
                    **{kind: per_sequence(entry[kind]) for kind in ("all", "lasting")}})
    return out


def ordinals(longest: int) -> list[str]:
    """The places before ``longest`` as table heads: 1st, 2nd, 3rd, 4th, ..."""
    return [f"{i}{'st' if i == 1 else 'nd' if i == 2 else 'rd' if i == 3 else 'th'}" for i in range(1, longest)]


def tokens_table(entries: list[dict], longest: int = 4, lasting: int = 6) -> str:
    rows = []
    for e in entries:
        for kind, phases, label in (("all", e["phases"], "every phase"), ("lasting", e["lasted"], f"≥ {lasting} steps")):
            rows.append([e["workload"], label, phases] + [counted(e[kind].get(i)) for i in range(1, longest + 1)])
    return markdown(["workload", "phases", "how many"] + [f"{h} step tok/seq (n)" for h in ordinals(longest)]
                    + [f"{longest}th and later tok/seq (n)"], rows)


def phase_table(entries: list[dict], longest: int = 4) -> str:
    return markdown(["gate cell"] + [f"{h} step ms (n)" for h in ordinals(longest)] + [f"{longest}th and later ms (n)"],
                    [[e["cell"]] + [counted(e["steps"].get(i)) for i in range(1, longest + 1)] for e in entries])


def markdown(heads: list[str], rows: list[list]) -> str:
    """A markdown table: ``heads``, then one line a row (cells as ``str`` gives them)."""
    lines = ["| " + " | ".join(heads) + " |", "|---" * len(heads) + "|"]
    return "\n".join(lines + ["| " + " | ".join(str(c) for c in row) + " |" for row in rows])


def replay_table(entries: list[dict]) -> str:
    return markdown(["workload", "c", "drafted as the winner", "would rest, calibrated", "probes", "factor after"],
                    [[e["workload"], e["concurrency"], e["winner_steps"], e["would_rest"], e["probes"],
                      f"{e['factor']:.2f}"] for e in entries])


def calibration_table(entries: list[dict]) -> str:
    return markdown(["workload", "c", "drafting steps decided there", "predicted tokens a sequence (mean)",
                     "emitted (mean)", "emitted / predicted"],
                    [[e["workload"], e["concurrency"], e["drafted"], f"{e['predicted']:.2f}", f"{e['emitted']:.2f}",
                      "-" if e["emitted_over_predicted"] is None else f"{e['emitted_over_predicted']:.2f}"]
                     for e in entries])


def prices_table(entries: list[dict], against: str) -> str:
    def num(v, fmt):
        return "-" if v is None else format(v, fmt)

    lines = [f"| workload | c | latest reports drafted | predicted tokens a sequence | implied drafting step ms | {against} "
             f"drafting step ms | implied / measured | {against} τ | scheduled ratio | {against} ratio |",
             "|---" * 10 + "|"]
    for e in entries:
        lines.append(f"| {e['workload']} | {e['concurrency']} | {e['drafted']} of {e['reports']} | "
                     f"{num(e['predicted_tokens'], '.2f')} | {num(e['implied_ms'], '.2f')} | "
                     f"{num(e['against_ms'], '.2f')} | {num(e['over'], '.2f')} | {num(e['against_tau'], '.2f')} | "
                     f"{num(e['ratio'], '.2f')} | {num(e['against_ratio'], '.2f')} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.gate_trace", description=__doc__.split("\n\n")[0])
    p.add_argument("result", type=Path, help="a speedup.json or .json.gz of bench speedup")
    p.add_argument("--cell", default=None, help="the gate cell, <gate key>_b<bucket>, e.g. dspark_b4")
    p.add_argument("--prices", action="store_true",
                   help="instead of one cell: every (workload, concurrency) cell's latest reports at its load "
                   "(median predicted tokens and implied drafting step) against the --against row's measured "
                   "drafting step and τ (prices())")
    p.add_argument("--calibration", action="store_true",
                   help="instead of one cell: per (workload, concurrency) cell, the drafting steps decided on a "
                   "prediction there, predicted against emitted tokens a sequence (calibration())")
    p.add_argument("--replay-calibration", action="store_true",
                   help="instead of one cell: per (workload, concurrency) cell, the drafting steps the gate took "
                   "as the winner and how many a calibrated gate (Cell.calibration) would have rested, from the "
                   "records (a counterfactual, replay_calibration())")
    p.add_argument("--phase-steps", action="store_true",
                   help="instead of one cell: each gate cell's drafting steps by their place in a drafting phase "
                   "(1st, 2nd, 3rd, later after a rest), median ms at a full batch (phase_steps())")
    p.add_argument("--replay-steady", action="store_true",
                   help="instead of one cell: per (workload, concurrency) cell, the steps the gate rested as the "
                   "winner and how many a steady-priced gate (SpecGate.steady_price) would have drafted, from the "
                   "records of a gate priced as measured (--row dspark-opening-priced since session 54; a "
                   "counterfactual, replay_steady())")
    p.add_argument("--reasons", action="store_true",
                   help="instead of one cell: per (workload, concurrency) cell, the tokens a sequence of the gate's "
                   "drafting steps by why they drafted (explore, class, probe, winner) beside the --against row's "
                   "τ (reasons(): the winner's steps are chosen by a prediction)")
    p.add_argument("--replay-class", action="store_true",
                   help="instead of one cell: per (workload, concurrency) cell, the steps the gate decided as the "
                   "winner and how many would have gone the other way with requests started from another class "
                   "record (--class-prior; a counterfactual upper bound, replay_class())")
    p.add_argument("--class-prior", choices=("long", "probes"), default="long",
                   help="with --replay-class: long, the class remembering ~200 drafting steps (SpecGate.class_decay "
                   "0.995, the dspark-class-long row); probes, a record of the class's probe steps only (not built)")
    p.add_argument("--phase-tokens", action="store_true",
                   help="instead of one cell: per workload, the tokens a sequence drafting steps emitted by their "
                   "place in a drafting phase, over every phase and over the phases of at least --lasting steps "
                   "(phase_tokens(): the later places of every phase hold only the phases that won)")
    p.add_argument("--lasting", type=positive_int, default=6, help="with --phase-tokens: a phase's steps to count as lasting")
    p.add_argument("--against", default="dspark-g7", help="with --prices or --reasons: the fixed-γ row to compare with")
    p.add_argument("--at", default=None, help="workload:concurrency, e.g. extraction.eval:4: that cell's latest "
                                              "reports (default: the run's first reports)")
    p.add_argument("--row", default=None, help="with --at or any view but --cell alone: the reports of this row's "
                                               "own gate (rows such as ngram-gated or dspark-probe-uncut run behind one)")
    args = p.parse_args(argv)
    undecided = "no drafting step decided on a prediction in any cell"
    views = {   # flag: (the run's entries, their table, what an empty run lacks)
        "phase_steps": (lambda r: phase_steps(r, args.row), phase_table,
                        "no drafting step of a full batch in any cell"),
        "phase_tokens": (lambda r: phase_tokens(r, args.row, lasting=args.lasting),
                         lambda e: tokens_table(e, lasting=args.lasting), "no drafting step in any cell"),
        "reasons": (lambda r: reasons(r, args.against, args.row), lambda e: reasons_table(e, args.against),
                    "no drafting step in any cell"),
        "replay_class": (lambda r: replay_class(r, args.row, prior=args.class_prior),
                         lambda e: class_table(e, args.class_prior),
                         "no step decided as the winner on a prediction in any cell"),
        "replay_calibration": (lambda r: replay_calibration(r, args.row), replay_table, undecided),
        "replay_steady": (lambda r: replay_steady(r, args.row), steady_table,
                          "no step rested as the winner on a prediction in any cell"),
        "calibration": (lambda r: calibration(r, args.row), calibration_table, undecided),
        "prices": (lambda r: prices(r, args.against, args.row), lambda e: prices_table(e, args.against),
                   f"no cell with both a gate decision and the row {args.against!r}"),
    }
    chosen = [flag for flag in views if getattr(args, flag)]
    if len(chosen) + (args.cell is not None) != 1:
        p.error("give one of --cell CELL, --prices, --calibration, --replay-calibration, --replay-steady, "
                "--replay-class, --reasons, --phase-steps or --phase-tokens")
    try:
        result = load(args.result)
        if args.row is not None:
            own_gates(result, args.row)
        if args.cell is not None:
            print(table(reports(result, args.cell, args.at, args.row)))
        else:
            entries_of, table_of, empty = views[chosen[0]]
            entries = entries_of(result)
            if not entries:
                raise PoolError(empty)
            print(table_of(entries))
    except PoolError as e:
        p.error(str(e))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
