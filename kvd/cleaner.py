"""The background cleaner: a thread that keeps every tier's free-slot reserve (kvd/watermarks.py) by
demoting policy victims one tier down, so the request path never copies (docs/design/kvd.md,
"Background cleaning").

Why a thread of its own and not the mover's: promotions are on a request's critical path and must not
queue behind a batch of NVMe writes. With ``threaded`` False (``move_workers == 0``) nothing runs in
the background: ``run_pending`` runs a pass inline (tick()/wait_ready() call it), as
``Mover.run_pending`` does, which keeps tests deterministic. ``clean_pass`` is the core's
``KvdCore.clean``: it takes kvd's lock only to plan and to finish each batch.
"""
from __future__ import annotations

import logging
import threading
from typing import Callable

from kvd.mover import side_stream

log = logging.getLogger(__name__)

PERIOD_S = 0.05  # also look without a wake-up: blocks become evictable on release, which wakes nobody


class Cleaner:
    def __init__(self, threaded: bool, clean_pass: Callable[[], int]) -> None:
        self._pass = clean_pass
        self._wake = threading.Event()
        self._stop = False
        self._thread = threading.Thread(target=self._loop, name="kvd-cleaner", daemon=True) if threaded else None
        if self._thread is not None:
            self._thread.start()

    @property
    def threaded(self) -> bool:
        return self._thread is not None

    def wake(self) -> None:
        """A reserve ran low: start a pass now (cheap; called under kvd's lock on the request path)."""
        self._wake.set()

    def run_pending(self) -> int:
        """One inline pass when there is no cleaner thread; returns the blocks it demoted."""
        if self._thread is not None:
            return 0
        self._wake.clear()
        return self._pass()

    def _loop(self) -> None:
        side_stream()
        while not self._stop:
            self._wake.wait(PERIOD_S)
            self._wake.clear()
            if self._stop:
                return
            try:
                self._pass()
            except Exception:  # noqa: BLE001 - a failed pass must not end cleaning for good
                log.exception("cleaner pass failed; continuing")

    def close(self) -> None:
        self._stop = True
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout=10)
