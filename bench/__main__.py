"""``python -m bench <subcommand>``: the benchmark harness.

Each subcommand is a module with ``add_arguments(parser)`` and ``run(args) -> int``; to add one, add
its module name to SUBCOMMANDS. Modules are imported only when their subcommand runs, so one
benchmark's heavy imports never slow down another.
"""
from __future__ import annotations

import argparse
import importlib
import sys
from typing import Optional, Sequence

SUBCOMMANDS: dict[str, str] = {
    "demo": "bench.demo",
    "kv-trace": "bench.kv_trace",
    "serve": "bench.serve",
    "serve-plan": "bench.serve_plan",
    "build-workloads": "bench.workloads.build",
    "eviction-ablation": "bench.eviction_ablation",
    "acceptance": "bench.acceptance",
    "drafter-pipeline": "bench.drafter_pipeline",
    "speedup": "bench.speedup",
    "sps-projection": "bench.sps_projection",
    "tier-bandwidth": "bench.tier_bandwidth",
}


def _summary(module: str) -> str:
    return (importlib.import_module(module).__doc__ or "").strip().splitlines()[0]


def main(argv: Optional[Sequence[str]] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = argparse.ArgumentParser(prog="python -m bench", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="subcommand", required=True, metavar="SUBCOMMAND")
    chosen = next((a for a in argv if not a.startswith("-")), None)
    for name, module in SUBCOMMANDS.items():
        if name == chosen:
            mod = importlib.import_module(module)
            p = sub.add_parser(name, help=_summary(module), description=mod.__doc__,
                               formatter_class=argparse.RawDescriptionHelpFormatter)
            mod.add_arguments(p)
            p.set_defaults(run=mod.run)
        else:
            sub.add_parser(name, help=f"see: python -m bench {name} --help")
    args = parser.parse_args(argv)
    return args.run(args)


if __name__ == "__main__":
    sys.exit(main())
