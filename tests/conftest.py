"""Suite-wide settings. TRITON_INTERPRET must be set before anything imports triton, so kernels run
under the interpreter on machines without a GPU."""
import gc
import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
torch.set_num_threads(min(2, os.cpu_count() or 1))


@pytest.fixture(autouse=True)
def _unfrozen_heap():
    """`bench speedup` freezes the heap as specd does (kvd/gc_pauses.py); in the one pytest
    process that would keep every later test's cycles out of the collector, so each test ends unfrozen."""
    yield
    if gc.get_freeze_count():
        gc.unfreeze()


class StepClock:
    """The engine's timers, made deterministic: every ``perf_counter`` call advances the clock by ``tick`` and
    ``sleep`` advances it by its argument, without waiting; ``monotonic`` stays real (arrival and queue times).

    Why: the gate rates each arm from the engine's step times, and the confidence scheduler sizes drafts from a
    verify profile timed at start-up (``SpsProfile.measure``). On the 2-core CI machine a ~2 ms step sometimes
    took 100+ ms, so tests of what the gate or the scheduler decide went red now and then (CI stop 32: 19
    rested steps against a bound of 20). Such tests check logic under a known cost, so the cost comes from
    this clock; outputs still come from the real model."""

    def __init__(self, tick: float = 1e-4):
        self.now, self.tick = 0.0, tick
        self.monotonic = __import__("time").monotonic

    def perf_counter(self) -> float:
        self.now += self.tick
        return self.now

    def sleep(self, seconds: float) -> None:
        self.now += seconds


@pytest.fixture
def step_clock(monkeypatch) -> StepClock:
    """A ``StepClock`` in place of the engine's step timer and of the verify profile's timer."""
    from specd.engine import engine as engine_module
    from specd.engine import spec_scheduler

    clock = StepClock()
    monkeypatch.setattr(engine_module, "time", clock)
    monkeypatch.setattr(spec_scheduler, "time", clock)
    return clock
