"""Asynchronous promotions: whole-block copies from DRAM/NVMe into the GPU pool.

Why a queue and not a copy inside lookup: a lookup must answer in microseconds; an NVMe read takes
milliseconds. The lookup leases the block (so nothing else touches its source or destination slot),
queues the copy and answers ``ready=False``. Copies run on ``workers`` threads, or inline in
``run_pending`` (called from tick()/wait_ready()) when workers is 0, which keeps tests deterministic.
``on_done(job, error)`` is called after each copy; the core finalizes the record under its lock.
"""
from __future__ import annotations

import queue
import threading
import time
from dataclasses import dataclass
from typing import Callable

import torch

from kvd.block_index import BlockRecord
from kvd.tiers import BlockMeta, BlockPool, move


@dataclass(eq=False)
class MoveJob:
    rec: BlockRecord
    group: str
    src: BlockPool
    src_slot: int
    dst: BlockPool
    dst_slot: int
    seconds: float = 0.0  # wall time of the copy (the tier rate estimate reads it)

    def run(self) -> None:
        meta = BlockMeta(self.rec.hash, self.rec.parent, self.rec.depth)
        t0 = time.perf_counter()
        move(self.src, self.src_slot, self.dst, self.dst_slot, meta)
        self.seconds = time.perf_counter() - t0


def side_stream() -> None:
    """Give the calling thread its own CUDA stream (when there is a GPU): tier copies then run
    beside the default stream's work instead of queueing behind it."""
    if torch.cuda.is_available():
        torch.cuda.set_stream(torch.cuda.Stream())


class Mover:
    def __init__(self, workers: int, on_done: Callable[[MoveJob, BaseException | None], None]) -> None:
        self._on_done = on_done
        self._q: queue.Queue[MoveJob | None] = queue.Queue()
        self._threads = [
            threading.Thread(target=self._loop, name=f"kvd-mover-{i}", daemon=True) for i in range(workers)
        ]
        for t in self._threads:
            t.start()

    def submit(self, job: MoveJob) -> None:
        self._q.put(job)

    def run_pending(self) -> int:
        """Run queued copies inline (only when there are no worker threads)."""
        if self._threads:
            return 0
        n = 0
        while True:
            try:
                job = self._q.get_nowait()
            except queue.Empty:
                return n
            self._run(job)
            n += 1

    def _run(self, job: MoveJob) -> None:
        try:
            job.run()
        except BaseException as e:  # reported, never lost: the core drops the block
            self._on_done(job, e)
        else:
            self._on_done(job, None)

    def _loop(self) -> None:
        side_stream()
        while (job := self._q.get()) is not None:
            self._run(job)

    def close(self) -> None:
        for _ in self._threads:
            self._q.put(None)
        for t in self._threads:
            t.join(timeout=5)
