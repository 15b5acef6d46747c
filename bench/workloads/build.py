"""Command line: build a workload's session file.

    python -m bench.workloads.build --workload support --split eval --sessions 64 --out support.eval.jsonl
    python -m bench build-workloads ...   (the same flags, through `add_arguments` and `run`)

`--workload all` writes the sessions of all five profiles into one file, ordered by arrival: mixed traffic.
`--workload unique` (not part of `all`) writes one-turn prompts that share no block: the 0%-hit overhead.
"""
from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from pathlib import Path

from bench.workloads import coding, creative, extraction, knowledge, support, unique
from bench.workloads.format import Session, write_sessions
from bench.workloads.profile import DEFAULT_CACHE_DIR, DEFAULT_MANIFEST_DIR, SCALES, BuildOptions, default_corpora_dir

PROFILES: dict[str, Callable[[BuildOptions], list[Session]]] = {
    "creative": creative.build,
    "support": support.build,
    "knowledge": knowledge.build,
    "coding": coding.build,
    "extraction": extraction.build,
}
BUILDERS = {**PROFILES, "unique": unique.build}


def build_sessions(workload: str, opts: BuildOptions) -> list[Session]:
    """Sessions of one builder, or of the five profiles merged by arrival time (ties keep profile order)."""
    if workload != "all":
        if workload not in BUILDERS:
            raise ValueError(f"unknown workload {workload!r}; choose from {', '.join(BUILDERS)} or all")
        return BUILDERS[workload](opts)
    merged = [s for build in PROFILES.values() for s in build(opts)]
    return sorted(merged, key=lambda s: s.arrival_s)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    d = BuildOptions()
    parser.add_argument("--workload", required=True, choices=[*BUILDERS, "all"])
    parser.add_argument("--split", default=d.split, choices=["train", "eval"],
                        help="drafter training uses train; every benchmark uses eval")
    parser.add_argument("--sessions", type=int, default=d.sessions, help="sessions per workload")
    parser.add_argument("--turns", type=int, default=None, help="turns per session (default: the profile's)")
    parser.add_argument("--time-scale", type=float, default=d.time_scale,
                        help="multiplies every arrival and think time; 0.01 turns minutes into seconds")
    parser.add_argument("--seed", type=int, default=d.seed, help="build seed (the train/eval split never moves)")
    parser.add_argument("--scale", choices=sorted(SCALES), default="full",
                        help="tiny: texts cut to 120 chars, 16-token answers, 2 turns, no tool schemas "
                             "(fits a 512-token model such as stories260K)")
    parser.add_argument("--max-chars", type=int, default=None, help="cut every long text to this many characters")
    parser.add_argument("--max-tokens", type=int, default=None, help="answer length of every turn")
    parser.add_argument("--rate", type=float, default=None, help="session arrivals per second, before time scaling")
    parser.add_argument("--file-chars", type=int, default=d.file_chars, help="coding: characters per file result")
    parser.add_argument("--docs", type=int, default=d.docs_per_question, help="knowledge: documents per question")
    parser.add_argument("--corpora", type=Path, default=default_corpora_dir())
    parser.add_argument("--cache-dir", type=Path, default=DEFAULT_CACHE_DIR)
    parser.add_argument("--split-dir", type=Path, default=DEFAULT_MANIFEST_DIR,
                        help="where the split manifests are recorded (committed in the repo)")
    parser.add_argument("--out", type=Path, required=True, help="the session JSONL file to write")


def options(args: argparse.Namespace) -> BuildOptions:
    return BuildOptions(
        split=args.split, sessions=args.sessions, turns=args.turns, time_scale=args.time_scale, seed=args.seed,
        scale=SCALES[args.scale], max_chars=args.max_chars, max_tokens=args.max_tokens, rate=args.rate,
        corpora_dir=args.corpora, manifest_dir=args.split_dir, cache_dir=args.cache_dir,
        file_chars=args.file_chars, docs_per_question=args.docs)


def run(args: argparse.Namespace) -> int:
    sessions = build_sessions(args.workload, options(args))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    n = write_sessions(args.out, sessions)
    turns = sum(len(s.turns) for s in sessions)
    print(f"wrote {n} sessions ({turns} turns) to {args.out}", file=sys.stderr)
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.workloads.build", description=__doc__.splitlines()[0])
    add_arguments(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
