"""The server loop waits, rather than spins, while every sequence is parked on a kvd promotion."""
from __future__ import annotations

import time


from specd.server import PARKED_POLL_MS, SpecdServer
from tests.serving.fake_engine import FakeEngine


class ParkedEngine(FakeEngine):
    """Has work (a parked request) but nothing it can run: every step only polls kvd."""

    def __init__(self, parked: bool):
        super().__init__()
        self.parked, self.steps = parked, 0

    def has_work(self) -> bool:
        return True

    def only_parked(self) -> bool:
        return self.parked

    def step(self):
        self.steps += 1
        return []


def turns_in(engine: ParkedEngine, tmp_path, seconds: float) -> int:
    server = SpecdServer(engine, f"ipc://{tmp_path / 'specd.sock'}")
    sock = server._bind()
    try:
        end = time.monotonic() + seconds
        while time.monotonic() < end:
            server._turn(sock)
    finally:
        sock.close(0)
    return engine.steps


def test_an_all_parked_engine_is_stepped_once_per_poll_wait(tmp_path):
    seconds = 0.2
    parked = turns_in(ParkedEngine(parked=True), tmp_path, seconds)
    assert 0 < parked <= seconds * 1000 / PARKED_POLL_MS * 1.2       # about one step per millisecond, no spin


def test_a_busy_engine_is_stepped_without_waiting(tmp_path):
    busy = turns_in(ParkedEngine(parked=False), tmp_path, 0.05)
    assert busy > 0.05 * 1000 / PARKED_POLL_MS * 3                    # no wait between steps
