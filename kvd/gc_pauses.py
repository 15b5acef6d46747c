"""The garbage collector's pauses in a serving loop: counted by generation, and the start-up heap frozen
out of them. Both daemons use it: specd's engine step, and kvd's server loop, whose pauses hold up every
client's lookups and the promotions parked requests wait for (it lives here because specd depends on kvd,
not the other way round).

Why: CPython's cyclic collector stops the thread that triggers it, and a full (generation 2) pass walks
every container object the process holds. With torch, the tokenizer and the engine loaded that is a few
hundred thousand objects: on the CPU machine a full pass over the bench's heap (~220-330k objects after
loading stories260K) took 113-182 ms, and a generation 1 pass up to 4 ms (``python -m bench speedup`` on
stories260K, passes timed with ``gc.callbacks``). A decode step on the H200 is 2-10 ms, so one full pass
lands in a step as a 10-50x outlier: an ITL p99 spike for users. Such passes are rare in steady serving
(most of a step's objects die by reference counting): on the H200 (session 18, runs BF-BI) no timed run
of ``bench speedup`` held a generation-2 pass, frozen or not, so they are not that bench's run-to-run
spread; the freeze guards against the rare long pause, it is no measured speed-up.

``gc.freeze()`` after start-up moves every object alive then (weights' Python wrappers, the tokenizer,
CUDA-graph pools, module state) to a permanent generation the collector no longer walks; what the loop
allocates later is collected as before. vLLM's engine core freezes its heap after start-up the same way.
Cycles among frozen objects are never freed, so the heap is collected first.
"""
from __future__ import annotations

import gc
import logging
import time

log = logging.getLogger("kvd.gc")

GENERATIONS = (0, 1, 2)


class GcPauses:
    """Collector passes and the seconds they took, by generation, since ``pauses()`` installed it
    (process-wide: the collector is one per interpreter, so every engine in the process reads the same
    counts)."""

    def __init__(self) -> None:
        self.passes = [0, 0, 0]
        self.seconds = [0.0, 0.0, 0.0]
        self.longest_s = 0.0
        self._started: float | None = None

    def on_gc(self, phase: str, info: dict) -> None:
        """``gc.callbacks`` hook: a pass is the time between its start and stop callbacks."""
        now = time.perf_counter()
        if phase == "start":
            self._started = now
            return
        if self._started is None:        # installed mid-pass
            return
        spent, self._started = now - self._started, None
        gen = info["generation"]
        self.passes[gen] += 1
        self.seconds[gen] += spent
        self.longest_s = max(self.longest_s, spent)

    def stats(self) -> dict[str, float | int]:
        out: dict[str, float | int] = {}
        for gen in GENERATIONS:
            out[f"gc_gen{gen}_passes_total"] = self.passes[gen]
            out[f"gc_gen{gen}_seconds_total"] = self.seconds[gen]
        out["gc_longest_pause_seconds"] = self.longest_s
        out["gc_frozen_objects"] = gc.get_freeze_count()
        return out


_pauses: GcPauses | None = None


def pauses() -> GcPauses:
    """The process's pause counter, installed in ``gc.callbacks`` on first use."""
    global _pauses
    if _pauses is None:
        _pauses = GcPauses()
        gc.callbacks.append(_pauses.on_gc)
    return _pauses


def freeze_heap(why: str) -> int:
    """Collect, then freeze every object alive now out of later passes; returns how many are frozen.
    Call it once start-up work is done (and again after more of it: freezing is cumulative)."""
    t0 = time.perf_counter()
    gc.collect()
    gc.freeze()
    frozen = gc.get_freeze_count()
    log.info("heap frozen after %s: %d objects, %.0f ms", why, frozen, 1e3 * (time.perf_counter() - t0))
    return frozen
