"""cProfile over a benchmark's timed runs, one profile per (row, concurrency).

Why: a drafting step that costs several plain steps has to be taken apart before it can be fixed, and
the parts (Python per sequence, kernel launches, the one synchronising copy that waits for the GPU) only
show with the real engine on the real device. ``bench speedup --profile DIR`` runs this; without a
directory every method is a no-op, so the timed path is unchanged.
"""
from __future__ import annotations

import cProfile
import io
import pstats
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

TOP = 45   # functions per table


class RowProfiles:
    def __init__(self, out: Path | None):
        self.out = out
        self.profiles: dict[tuple[str, int], cProfile.Profile] = {}

    @contextmanager
    def timed(self, row: str, concurrency: int) -> Iterator[None]:
        if self.out is None:
            yield
            return
        prof = self.profiles.setdefault((row, concurrency), cProfile.Profile())
        prof.enable()
        try:
            yield
        finally:
            prof.disable()

    def write(self) -> list[Path]:
        """One text file per (row, concurrency): the top functions by own time, then by cumulative time."""
        if self.out is None:
            return []
        self.out.mkdir(parents=True, exist_ok=True)
        written = []
        for (row, level), prof in sorted(self.profiles.items()):
            path = self.out / f"profile-{row}-c{level}.txt"
            path.write_text(render(prof))
            written.append(path)
        return written


def render(prof: cProfile.Profile) -> str:
    parts = []
    for key in ("tottime", "cumulative"):
        buf = io.StringIO()
        pstats.Stats(prof, stream=buf).strip_dirs().sort_stats(key).print_stats(TOP)
        parts.append(f"## by {key}\n\n{buf.getvalue()}")
    return "\n".join(parts)


class TorchProfiles:
    """``torch.profiler`` over a benchmark's timed runs: per (row, concurrency) each op's and kernel's calls,
    self device time and self CPU time, summed over the runs; one table per concurrency with the rows side
    by side, the names whose device time differs most between rows first.

    Why: a resting scheduled row ran 4% behind `none` at knowledge c = 32 on the H200 (session 15, run AU)
    with no difference in the host path a CPU run can see (tests/engine/rest_capture_probe.py), and
    cProfile only shows the host waiting for the device. The kernels each row launched, and their GPU
    time, say where the device time goes. ``bench speedup --torch-profile DIR`` runs this; without a
    directory it is a no-op. The profiler slows the runs it watches: their tok/s are no speed result."""

    def __init__(self, out: Path | None):
        self.out = out
        self.tables: dict[tuple[str, int], dict[str, list[float]]] = {}

    @contextmanager
    def timed(self, row: str, concurrency: int) -> Iterator[None]:
        if self.out is None:
            yield
            return
        import torch
        from torch.profiler import ProfilerActivity, profile

        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
        with profile(activities=activities) as prof:
            yield
        table = self.tables.setdefault((row, concurrency), {})
        for ev in prof.key_averages():
            device = getattr(ev, "self_device_time_total", None)
            if device is None:
                device = getattr(ev, "self_cuda_time_total", 0.0)
            entry = table.setdefault(ev.key, [0, 0.0, 0.0])
            entry[0] += ev.count
            entry[1] += device
            entry[2] += ev.self_cpu_time_total

    def write(self) -> list[Path]:
        """One markdown file per concurrency, ``torch-profile-c<N>.md``."""
        if self.out is None:
            return []
        self.out.mkdir(parents=True, exist_ok=True)
        written = []
        for level in sorted({lvl for _, lvl in self.tables}):
            rows = sorted(r for r, lvl in self.tables if lvl == level)
            path = self.out / f"torch-profile-c{level}.md"
            path.write_text(render_side_by_side({r: self.tables[(r, level)] for r in rows}, level))
            written.append(path)
        return written


def render_side_by_side(tables: dict[str, dict[str, list[float]]], level: int) -> str:
    """Rows side by side: calls, self device ms and self CPU ms of each name, the largest spread of device
    time between rows first, then of CPU time; totals on top."""
    rows = list(tables)
    names = set().union(*(t.keys() for t in tables.values()))

    def col(row: str, name: str) -> list[float]:
        return tables[row].get(name, [0, 0.0, 0.0])

    def spread(name: str, i: int) -> float:
        values = [col(r, name)[i] for r in rows]
        return max(values) - min(values)

    head = "| name | " + " | ".join(f"{r} calls | {r} device ms | {r} CPU ms" for r in rows) + " |"
    rule = "|---|" + "---|---|---|" * len(rows)
    totals = "| **total** | " + " | ".join(
        f"{sum(v[0] for v in tables[r].values()):.0f} | {sum(v[1] for v in tables[r].values()) / 1e3:.1f} | "
        f"{sum(v[2] for v in tables[r].values()) / 1e3:.1f}" for r in rows) + " |"
    lines = [f"# torch.profiler over the timed runs, concurrency {level}", "",
             "Self times summed over every timed run of each row (profiled runs are slower: no speed result).",
             ""]
    for title, i in (("by device time spread", 1), ("by CPU time spread", 2)):
        lines += [f"## {title}", "", head, rule, totals]
        for name in sorted(names, key=lambda n: (-spread(n, i), n))[:TOP]:      # ties by name: stable tables
            cells = " | ".join(f"{col(r, name)[0]:.0f} | {col(r, name)[1] / 1e3:.3f} | {col(r, name)[2] / 1e3:.3f}"
                               for r in rows)
            lines.append(f"| `{name[:90]}` | {cells} |")
        lines.append("")
    return "\n".join(lines)
