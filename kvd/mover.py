"""Asynchronous promotions: one batch per lease (kvd/promotion.py) from DRAM/NVMe into the GPU pool.

Why a queue and not a copy inside lookup: a lookup must answer in microseconds; an NVMe read takes
milliseconds. The lookup leases the blocks (so nothing else touches their source or destination slots),
queues one batch and answers ``ready=False``. Batches run on ``workers`` threads, or inline in
``run_pending`` (called from tick()/wait_ready()) when workers is 0, which keeps tests deterministic.
``on_done(batch)`` is called once per batch; the core finalizes every record under its lock once.

Promotions come before demotions: the cleaner (kvd/cleaner.py) calls ``wait_idle`` before each of its
batches, so a promotion queued meanwhile does not wait behind the cleaner's copies and lock trips.
"""
from __future__ import annotations

import queue
import threading
import time
from typing import Callable

import torch

from kvd.promotion import PromotionBatch


def side_stream() -> None:
    """Give the calling thread its own CUDA stream (when there is a GPU): tier copies then run
    beside the default stream's work instead of queueing behind it."""
    if torch.cuda.is_available():
        torch.cuda.set_stream(torch.cuda.Stream())


class Mover:
    def __init__(self, workers: int, on_done: Callable[[PromotionBatch], None]) -> None:
        self._on_done = on_done
        self._q: queue.Queue[PromotionBatch | None] = queue.Queue()
        self._pending = 0                      # submitted, not yet finished
        self._idle = threading.Condition()
        self.batches = 0                       # finished batches (stats: jobs per promoted block)
        self._threads = [
            threading.Thread(target=self._loop, name=f"kvd-mover-{i}", daemon=True) for i in range(workers)
        ]
        for t in self._threads:
            t.start()

    def submit(self, batch: PromotionBatch) -> None:
        batch.submitted_at = time.perf_counter()
        with self._idle:
            self._pending += 1
        self._q.put(batch)

    def wait_idle(self, timeout: float) -> bool:
        """Wait up to ``timeout`` s until no promotion is queued or running; True if idle. The cleaner's
        yield: bounded, so a steady stream of promotions slows cleaning down but never stops it."""
        with self._idle:
            return self._idle.wait_for(lambda: self._pending == 0, timeout)

    def run_pending(self) -> int:
        """Run queued batches inline (only when there are no worker threads)."""
        if self._threads:
            return 0
        n = 0
        while True:
            try:
                batch = self._q.get_nowait()
            except queue.Empty:
                return n
            self._run(batch)   # type: ignore[arg-type]
            n += 1

    def _run(self, batch: PromotionBatch) -> None:
        """Run one batch, timing its wait in the queue and its copy apart (kvd stats: a parked request's
        wait is queue + copy + the engine's pick-up at its next step)."""
        t0 = time.perf_counter()
        batch.queue_s = t0 - batch.submitted_at if batch.submitted_at else 0.0
        try:
            try:
                batch.run()
            except BaseException as e:  # reported, never lost: the core drops the blocks
                batch.fail_unfinished(e)
            batch.copy_s = time.perf_counter() - t0
            self._on_done(batch)
        finally:
            with self._idle:
                self._pending -= 1
                self.batches += 1
                self._idle.notify_all()

    def _loop(self) -> None:
        side_stream()
        while (batch := self._q.get()) is not None:
            self._run(batch)

    def close(self) -> None:
        for _ in self._threads:
            self._q.put(None)
        for t in self._threads:
            t.join(timeout=5)
