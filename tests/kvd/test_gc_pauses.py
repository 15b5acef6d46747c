"""The collector's pause counter and the heap freeze (kvd/gc_pauses.py)."""
from __future__ import annotations

import gc

from kvd import gc_pauses
from kvd.gc_pauses import GcPauses, freeze_heap, pauses


def test_a_pass_is_counted_by_generation_from_its_start_to_its_stop():
    p = GcPauses()
    p.on_gc("stop", {"generation": 2})          # installed mid-pass: no start seen, nothing counted
    p.on_gc("start", {"generation": 1})
    p.on_gc("stop", {"generation": 1, "collected": 0})
    p.on_gc("start", {"generation": 2})
    p.on_gc("stop", {"generation": 2, "collected": 3})
    s = p.stats()
    assert [s[f"gc_gen{g}_passes_total"] for g in (0, 1, 2)] == [0, 1, 1]
    assert s["gc_gen0_seconds_total"] == 0.0 and s["gc_gen1_seconds_total"] > 0 and s["gc_gen2_seconds_total"] > 0
    assert s["gc_longest_pause_seconds"] == max(s["gc_gen1_seconds_total"], s["gc_gen2_seconds_total"])


def test_the_installed_counter_sees_real_collections_once():
    p = pauses()
    assert pauses() is p and gc.callbacks.count(p.on_gc) == 1
    before = p.stats()
    gc.collect()
    gc.collect(0)
    after = p.stats()
    assert after["gc_gen2_passes_total"] == before["gc_gen2_passes_total"] + 1
    assert after["gc_gen0_passes_total"] >= before["gc_gen0_passes_total"] + 1
    assert after["gc_gen2_seconds_total"] > before["gc_gen2_seconds_total"]


def test_freezing_moves_what_is_alive_out_of_later_passes():
    class Node:
        pass

    keep = [Node() for _ in range(1000)]
    try:
        frozen = freeze_heap("a test")
        # frozen objects still die by reference counting, so the count only shrinks after the freeze
        assert frozen >= len(keep) and len(keep) <= pauses().stats()["gc_frozen_objects"] <= frozen
        assert not any(o is keep[0] for o in gc.get_objects())     # frozen objects are not walked any more
    finally:
        gc.unfreeze()
    assert gc.get_freeze_count() == 0 and gc_pauses.GENERATIONS == (0, 1, 2)


def test_kvd_freezes_its_start_up_heap_by_default():
    """The kvd daemon's switch (kvd/__main__.py calls freeze_heap after binding); the real daemon's frozen
    count is checked in tests/kvd_io/test_daemon.py."""
    from kvd.__main__ import build_parser
    from kvd.config import KvdConfig
    assert KvdConfig(run_dir="/tmp/x").gc_freeze is True
    assert KvdConfig(run_dir="/tmp/x", gc_freeze=False).gc_freeze is False
    assert "--gc-freeze" in build_parser().format_help()
