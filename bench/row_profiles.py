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
