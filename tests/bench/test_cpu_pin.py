"""bench.cpu_pin: the CPU list a run is pinned to, and the pinning of every thread."""
from __future__ import annotations

import argparse
import os
import threading

import pytest

from bench.cpu_pin import cpu_set, pin


def test_cpu_lists_parse_ranges_and_refuse_bad_or_unavailable_cpus():
    first = min(os.sched_getaffinity(0))
    assert cpu_set(str(first)) == {first}
    assert cpu_set(f"{first}-{first}, {first}") == {first}
    for bad in ("", "a", "3-1", "-1", ","):
        with pytest.raises(argparse.ArgumentTypeError, match="bad CPU list"):
            cpu_set(bad)
    with pytest.raises(argparse.ArgumentTypeError, match="not available"):
        cpu_set("100000")


def test_pinning_reaches_a_thread_started_before_it_and_one_started_after():
    before = os.sched_getaffinity(0)
    if len(before) < 2:
        pytest.skip("one CPU: a pinned thread looks like an unpinned one")
    one = {min(before)}
    seen: dict[str, set[int]] = {}
    go = threading.Event()

    def early():
        go.wait()
        seen["early"] = os.sched_getaffinity(0)

    t = threading.Thread(target=early)
    t.start()
    try:
        assert pin(one) >= 2                    # this thread and the early one
        go.set()
        t.join()
        late = threading.Thread(target=lambda: seen.setdefault("late", os.sched_getaffinity(0)))
        late.start()
        late.join()
        assert os.sched_getaffinity(0) == one and seen == {"early": one, "late": one}
    finally:
        go.set()
        pin(before)
    assert os.sched_getaffinity(0) == before
