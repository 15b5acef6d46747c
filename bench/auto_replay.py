"""Replay speculation method `auto`'s chooser (specd/engine/method_choice.py) offline, on the requests a
`bench speedup` run measured under each candidate's own row.

    python -m bench.auto_replay RESULT/speedup.json.gz [--concurrency 1] \\
        [--gated dspark=dspark,ngram=ngram-gated] [--measuring dspark=dspark-g7,ngram=ngram] \\
        [--explore 2] [--explore-tokens 256] [--probe-first 8] [--draft-most 1] [--warm-repeats 0]

Why: each version of the chooser took a GPU run to judge (session 56: three runs, ~900 s of device time),
and each run showed a different way for it to go wrong. The rows `dspark` and `ngram-gated` already measure
every request under each candidate: the same prompts, the same seeds, in the same order. So a chooser can be
run over them here: at each request of a cell it picks a method, and the replay takes that method's row's
record of the same request (its tokens, and its seconds from first token to finish) as the outcome, feeding
it back as the engine does. A request the chooser sends to measure its method and that drafts at every step
(``Choice.drafts``: at load bucket 1 by default) takes the ``--measuring`` row's record (fixed γ: `dspark-g7`,
`ngram`) where the run has it.

What it is and is not: at c = 1 a request's decode time does not depend on the others, so the replay is
close to what the engine would do (prompt steps and gaps between requests left out). At c > 1 a request's
rate depends on its batch, which in the rows is all one method; the replay is then an estimate. Each cell
starts from the chooser's state after the cells before it (the bench's order: workload, then concurrency),
and without the untimed warm-ups. Runs made before ``RunResult.requests`` existed (session 56's NA-NF among
them) did not record their requests; they are refused by name.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

from bench.speedup_pool import PoolError, load
from specd.engine.method_choice import DRAFT_MOST, EXPLORE, EXPLORE_TOKENS, PROBE_FIRST, MethodChoice
from specd.engine.spec_gate import load_bucket


class ReplayError(ValueError):
    """A result that cannot be replayed, said why."""


def pairs(text: str) -> dict[str, str]:
    """``method=row,method=row`` to a mapping; empty text to an empty one."""
    out = {}
    for item in filter(None, (x.strip() for x in text.split(","))):
        method, sep, row = item.partition("=")
        if not sep or not method or not row:
            raise argparse.ArgumentTypeError(f"expected method=row[,method=row], got {text!r}")
        out[method.strip()] = row.strip()
    return out


def _records(cell: dict, row: str, where: str) -> list[dict[int, tuple[int, float]]]:
    """Per repeat of ``row`` in ``cell``: prompt index -> (tokens, seconds)."""
    if row not in cell["rows"]:
        raise ReplayError(f"{where}: no row {row!r} (have {', '.join(cell['rows'])})")
    runs = cell["rows"][row]["runs"]
    if any(not r.get("requests") for r in runs):
        raise ReplayError(f"{where}: row {row!r} has no per-request records (runs made before "
                          f"RunResult.requests existed kept none, session 56's NA-NF among them)")
    return [{i: (n, s) for i, n, s, *_ in r["requests"]} for r in runs]   # the method: session 60 on


def replay(result: dict, gated: dict[str, str], measuring: dict[str, str], levels: list[str],
           chooser: MethodChoice, warm: int = 0) -> list[dict]:
    """One dict per (workload, concurrency) cell replayed, in the bench's order: the per-user rate (tokens over
    seconds, summed over the cell's requests) of `none`, of each candidate's row, and of the chooser's
    picks, and the requests it gave each method. The first ``warm`` repeats of each cell go through the
    chooser uncounted, as the auto row's whole-answer warm-ups do (``bench.speedup.explore_auto``)."""
    candidates = tuple(gated)
    out = []
    for workload, cells in result["workloads"].items():
        for level in levels:
            if level not in cells:
                continue
            cell, where = cells[level], f"{workload} c={level}"
            rows = {m: _records(cell, row, where) for m, row in gated.items()}
            fixed = {m: _records(cell, row, where) for m, row in measuring.items() if row in cell["rows"]}
            base = _records(cell, "none", where)
            totals = {name: [0, 0.0] for name in ("none", *gated.values(), "auto")}
            given: dict[str, int] = {}
            if warm >= len(base):
                raise ReplayError(f"{where}: {len(base)} repeats, none left after {warm} warm ones")
            for rep, plain in enumerate(base):
                for i in sorted(plain):           # the closed loop admits the prompts in index order
                    choice = chooser.choose(workload, load_bucket(int(level)), candidates)
                    source = fixed if choice.drafts and choice.method in fixed else rows
                    if any(i not in recs[rep] for recs in (*rows.values(), *fixed.values())):
                        raise ReplayError(f"{where}: request {i} of repeat {rep} is missing from a row")
                    tokens, seconds = source[choice.method][rep][i]
                    chooser.observe(workload, load_bucket(int(level)), choice.method, max(0, tokens - 1), seconds,
                                    measured=choice.measures)
                    if rep < warm:                # primes the chooser, uncounted
                        continue
                    given[choice.method] = given.get(choice.method, 0) + 1
                    for name, recs in (("none", plain), *((gated[m], rows[m][rep]) for m in candidates)):
                        totals[name][0] += recs[i][0]
                        totals[name][1] += recs[i][1]
                    totals["auto"][0] += tokens
                    totals["auto"][1] += seconds
            rates = {name: t / s if s > 0 else 0.0 for name, (t, s) in totals.items()}
            out.append({"workload": workload, "concurrency": int(level), "per_user_tok_s": rates,
                        "given": given})
    return out


def markdown(cells: list[dict], gated: dict[str, str]) -> str:
    names = list(gated.values())
    lines = ["| workload | c | " + " | ".join(f"`{n}`" for n in names) + " | `auto`, replayed | requests given |",
             "|---|---|" + "---|" * (len(names) + 2)]
    for c in cells:
        r = c["per_user_tok_s"]
        plain = r["none"] or 1.0
        given = ", ".join(f"{m} {n}" for m, n in sorted(c["given"].items()))
        lines.append(f"| {c['workload']} | {c['concurrency']} | "
                     + " | ".join(f"{r[n] / plain:.2f}" for n in names) + f" | {r['auto'] / plain:.2f} | {given} |")
    lines.append("")
    lines.append("Per-user rate over `none`'s (tokens over seconds from first token to finish, summed over the "
                 "cell's requests). At c > 1 the replay is an estimate: a request's rate depends on its batch.")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.auto_replay", description=__doc__.split("\n\n")[0])
    p.add_argument("result", type=Path, help="speedup.json or .json.gz of a bench speedup run")
    p.add_argument("--concurrency", default="1", help="comma-separated levels to replay, in order (default 1)")
    p.add_argument("--gated", type=pairs, default=pairs("dspark=dspark,ngram=ngram-gated"),
                   help="candidate=row whose requests are the candidate's ordinary ones (order: preference)")
    p.add_argument("--measuring", type=pairs, default=pairs("dspark=dspark-g7,ngram=ngram"),
                   help="candidate=row for the requests sent to measure it (drafting throughout); a row the "
                        "run lacks falls back to --gated's")
    p.add_argument("--explore", type=int, default=EXPLORE, help="MethodChoice's explore (requests)")
    p.add_argument("--explore-tokens", type=int, default=EXPLORE_TOKENS, help="MethodChoice's explore_tokens")
    p.add_argument("--probe-first", type=int, default=PROBE_FIRST, help="MethodChoice's probe_first")
    p.add_argument("--draft-most", type=int, default=DRAFT_MOST,
                   help="MethodChoice's draft_most: the largest load bucket where a measuring request drafts "
                        "throughout (and takes --measuring's record)")
    p.add_argument("--warm-repeats", type=int, default=0,
                   help="repeats of each cell that prime the chooser uncounted (the auto row's whole-answer "
                        "warm-ups); the rest are counted")
    args = p.parse_args(argv)
    try:
        chooser = MethodChoice(explore=args.explore, explore_tokens=args.explore_tokens,
                               probe_first=args.probe_first, probe_most=max(64, args.probe_first),
                               draft_most=args.draft_most)
        cells = replay(load(args.result), args.gated, args.measuring,
                       [c.strip() for c in args.concurrency.split(",") if c.strip()], chooser,
                       args.warm_repeats)
    except (ReplayError, PoolError, ValueError) as exc:
        print(f"auto_replay: {exc}", file=sys.stderr)
        return 2
    if not cells:
        print("auto_replay: no cell of that concurrency in the result", file=sys.stderr)
        return 2
    sys.stdout.write(markdown(cells, args.gated))
    return 0


if __name__ == "__main__":
    sys.exit(main())
