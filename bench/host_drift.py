"""How many timed runs of a `bench speedup` table ran on a slow host: a noise meter printed with every table.

Why: on the H200's host, 11-29% of the timed runs ran their host-only phases (output and commit: Python,
no kernels) ≥ 1.2× slower than the same row's fastest repeat of the same cell, 5-13% ≥ 1.4× (the largest 3.4-9.4×),
with every other phase slower with them (session 28, runs CI and CJ; session 18, BH and BI). A run like
that moves its cell's ratio by 5-20% whichever row it hits. The count says how much of a table's spread is the host's,
and whether a change meant to steady it (``--cpus``, bench/cpu_pin.py) did.
"""
from __future__ import annotations

HOST_PHASES = ("output", "commit")   # per-step phases with no device work in them
THRESHOLDS = (1.2, 1.4)


def host_ms(run: dict) -> float | None:
    phases = run.get("phase_ms_per_step", {})
    if not all(k in phases for k in HOST_PHASES):
        return None
    return sum(phases[k] for k in HOST_PHASES)


def slowdowns(workloads: dict) -> list[float]:
    """Each timed run's host-only ms per step over the fastest repeat of its row in its cell."""
    out = []
    for cells in workloads.values():
        for cell in cells.values():
            for row in cell["rows"].values():
                times = [t for t in (host_ms(r) for r in row["runs"]) if t]
                if len(times) >= 2:
                    fastest = min(times)
                    out += [t / fastest for t in times]
    return out


def host_drift_line(workloads: dict) -> str:
    """One markdown line: the timed runs whose host-only phases ran ≥ 1.2× and ≥ 1.4× their row's fastest
    repeat of the cell (rows with one repeat do not count)."""
    ratios = slowdowns(workloads)
    if not ratios:
        return "Host drift: no row with two repeats and phase times."
    counts = ", ".join(f"≥ {t:.1f}×: {sum(r >= t for r in ratios)}" for t in THRESHOLDS)
    return (f"Host drift (output and commit ms per step over the row's fastest repeat of the cell), timed runs "
            f"of {len(ratios)}: {counts}.")
