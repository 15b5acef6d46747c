"""Ownership of kvd's shared-memory pool files, so a crashed kvd's pools do not pile up in /dev/shm.

Why: the GPU-tier fallback and the DRAM tier live in /dev/shm files named ``kvd-<pid>-<id>-<group>-<tier>.pool``.
A kvd killed with SIGKILL never unlinks them, and tmpfs keeps their pages: a few crashes of a daemon with a
32 GiB DRAM tier exhaust the machine's shared memory, and the next DRAM tier fails to reserve. Each owner
holds an exclusive ``flock`` on its pool files for as long as it lives (the kernel drops it when the process
dies, however it dies, and it works across PID namespaces that share /dev/shm); a starting kvd removes every
pool file it can lock. Readers (specd maps the files) never lock them.
"""
from __future__ import annotations

import fcntl
import logging
import os
from pathlib import Path

log = logging.getLogger(__name__)

PATTERN = "kvd-*.pool"


def hold(path: Path) -> int:
    """Lock ``path`` for this process; returns the fd, which must stay open while the pool lives."""
    fd = os.open(path, os.O_RDONLY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        os.close(fd)
        raise
    return fd


def reap_stale(directory: Path) -> list[Path]:
    """Remove the pool files in ``directory`` whose owner is gone (their lock can be taken); returns them."""
    removed = []
    for path in sorted(directory.glob(PATTERN)):
        try:
            fd = os.open(path, os.O_RDONLY)
        except OSError:
            continue                               # vanished meanwhile, or not ours to read
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            continue                               # a live kvd holds it
        except OSError:
            continue
        else:
            try:
                path.unlink()
                removed.append(path)
            except OSError:
                pass
        finally:
            os.close(fd)
    if removed:
        log.warning("removed %d pool file(s) of dead kvd processes from %s", len(removed), directory)
    return removed
