"""Pin a benchmark process, every thread of it, to a set of CPUs (``bench speedup --cpus``).

Why: on the H200's host, 11-29% of `bench speedup`'s timed runs ran their host-only phases ≥ 1.2× slower than
the same row's fastest repeat of the cell, and 5-13% ≥ 1.4×, with every phase slower together (schedule,
output, commit, and the forward's launches; session 28, runs CI and CJ, and session 18's BH and BI). Such a run
moves its cell's ratio by 5-20% whichever row it hits, and it hits the A/A row as often as the others.
Whether the slow runs come from the process moving between cores (which pinning stops) or from the host
itself (which it cannot) is not known; `--cpus` lets one run answer it against another's A/A spread.
A deployment does the same with systemd's ``CPUAffinity=``.
"""
from __future__ import annotations

import argparse
import os


def cpu_set(text: str) -> set[int]:
    """argparse type: '2', '2-5' or '0,2-3' -> the CPUs, each one this process may run on."""
    cpus: set[int] = set()
    try:
        for part in (p.strip() for p in text.split(",")):
            if not part:
                continue
            lo, _, hi = part.partition("-")
            first, last = int(lo), int(hi) if hi else int(lo)
            if first < 0 or last < first:
                raise ValueError
            cpus.update(range(first, last + 1))
    except ValueError:
        raise argparse.ArgumentTypeError(f"bad CPU list {text!r} (e.g. 2, 2-5 or 0,2-3)") from None
    if not cpus:
        raise argparse.ArgumentTypeError(f"bad CPU list {text!r}: no CPU in it")
    allowed = os.sched_getaffinity(0)
    if not cpus <= allowed:
        raise argparse.ArgumentTypeError(f"CPUs {sorted(cpus - allowed)} are not available here "
                                         f"(this process may use {sorted(allowed)})")
    return cpus


def pin(cpus: set[int]) -> int:
    """Pin every thread the process has now to ``cpus`` (threads started later inherit it from the thread
    that starts them); returns how many threads were pinned. Linux applies an affinity to one thread, so
    the process's own threads (torch's, the CUDA driver's if already started) are walked one by one."""
    tids = [int(t) for t in os.listdir("/proc/self/task")] if os.path.isdir("/proc/self/task") else [0]
    pinned = 0
    for tid in tids:
        try:
            os.sched_setaffinity(tid, cpus)
            pinned += 1
        except ProcessLookupError:      # a thread that ended since the listing
            continue
    return pinned
