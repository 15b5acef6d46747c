"""A raw ZeroMQ ROUTER bound where a client looks for kvd: the test decides which requests are answered,
when, and whether at all (lost replies, late answers, a kvd that never replies)."""
from __future__ import annotations

from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

import zmq


@contextmanager
def fake_kvd_socket(run_dir: Path, recv_timeout_ms: int = 5000) -> Iterator[zmq.Socket]:
    """``run_dir``/kvd.sock served by a ROUTER (created with the folder); closed on exit."""
    run_dir.mkdir(parents=True, exist_ok=True)
    router = zmq.Context.instance().socket(zmq.ROUTER)
    router.setsockopt(zmq.LINGER, 0)
    router.setsockopt(zmq.RCVTIMEO, recv_timeout_ms)
    router.bind(f"ipc://{run_dir / 'kvd.sock'}")
    try:
        yield router
    finally:
        router.close(0)
