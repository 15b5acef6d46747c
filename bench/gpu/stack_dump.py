"""Run a ``python -m`` module for a while and dump every thread's Python stack at intervals.

    python -m bench.gpu.stack_dump --every 20 --for 75 --out stacks.txt -- bench drafter-pipeline ARGS...

Why: session 7's first device call ran the drafter pipeline's data stage (``--answers engine``) for 540 s
on the H200 with no output, where session 3 had finished it in 207 s; the device has no py-spy, and a
device call is too short to guess twice. ``faulthandler`` writes the stacks from a watchdog thread even
when the main thread is inside a C call (a CUDA sync, a graph capture), then the run is cut at ``--for``.
"""
from __future__ import annotations

import argparse
import faulthandler
import os
import runpy
import sys
import threading


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--every", type=float, default=20.0, help="seconds between dumps")
    p.add_argument("--for", dest="total", type=float, default=75.0, help="seconds before the run is cut")
    p.add_argument("--out", required=True, help="file the dumps are appended to")
    p.add_argument("module", nargs=argparse.REMAINDER, help="-- MODULE ARGS...")
    a = p.parse_args()
    argv = a.module[1:] if a.module[:1] == ["--"] else a.module
    if not argv:
        p.error("name a module to run after --")
    out = open(a.out, "a", buffering=1)
    faulthandler.dump_traceback_later(a.every, repeat=True, file=out)

    def cut() -> None:   # no dump from here: faulthandler.dump_traceback off the main thread can crash
        out.write(f"\n--- cut after {a.total} s ---\n")
        out.flush()
        os._exit(124)

    threading.Timer(a.total, cut).start()
    sys.argv = argv
    code = 0
    try:
        runpy.run_module(argv[0], run_name="__main__", alter_sys=True)
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


if __name__ == "__main__":
    main()
