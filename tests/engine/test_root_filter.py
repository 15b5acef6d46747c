"""specd's mirror of kvd's first blocks (specd/engine/root_filter.py): the pure logic, then end to end on
stories260K against a real kvd process. The filter may only skip lookups that would miss."""
from __future__ import annotations

import pytest

from specd.engine.root_filter import RootFilter

A, B, C, D = (bytes([i]) * 16 for i in range(1, 5))


def answered_whole(f: RootFilter, roots, version=7, now=0.0):
    assert f.asked(now) is None                 # no mirror (or resync due): the whole set is asked for
    f.answered({"version": version, "filterable": True, "roots": list(roots)})


def test_unknown_mirror_looks_everything_up_and_a_known_one_skips_absent_first_blocks():
    f = RootFilter()
    assert f.may_hit([A, B]) and f.may_hit([C])
    answered_whole(f, [A])
    assert f.may_hit([A, C]) and not f.may_hit([C, A]) and f.may_hit([])
    assert f.skipped == 1 and f.unreported == [1, 2]
    f.asked(1.0)
    assert f.unreported == [0, 0]               # reported with that ask


def test_changes_apply_to_the_version_they_were_asked_against():
    f = RootFilter(refresh_s=0.05, resync_s=100.0)
    answered_whole(f, [A, B], version=7)
    assert not f.due(0.01) and f.due(0.06)      # answered at 0.0: due again after refresh_s
    assert f.asked(0.06) == 7
    f.answered({"version": 9, "filterable": True, "since": 7, "added": [C], "removed": [A]})
    assert f.roots == {B, C} and f.version == 9
    f.asked(0.2)
    f.answered({"version": 12, "filterable": True, "since": 8, "added": [D], "removed": []})
    assert f.roots is None and f.version is None        # a change from a version we never held
    assert f.may_hit([D]) and f.asked(0.3) is None


def test_own_commits_are_hittable_at_once_and_survive_an_answer_that_predates_them():
    f = RootFilter(resync_s=100.0)
    answered_whole(f, [A])
    f.committed(C)
    assert f.may_hit([C])
    f.asked(1.0)
    f.committed(D)                              # after the ask: kvd's answer cannot list it
    f.answered({"version": 8, "filterable": True, "since": 7, "added": [], "removed": [C]})
    assert f.may_hit([D]) and not f.may_hit([C])
    f.asked(2.0)
    f.committed(B)
    f.answered({"version": 9, "filterable": True, "roots": [A]})     # a whole set, also without it
    assert f.may_hit([B])


def test_errors_forget_the_mirror_and_an_unfilterable_group_turns_it_off():
    f = RootFilter()
    answered_whole(f, [A])
    f.asked(1.0)
    f.answered(RuntimeError("kvd refused"))
    assert f.roots is None and f.may_hit([C]) and f.due(2.0)
    f.asked(2.0)
    f.answered({"version": 0, "filterable": False})
    assert not f.enabled and not f.due(10.0) and f.may_hit([C])
    assert f.due(10.0, urgent=True)             # the source still sends its block price once


def test_resync_asks_for_the_whole_set_again():
    f = RootFilter(refresh_s=0.05, resync_s=1.0)
    answered_whole(f, [A], now=0.0)
    assert f.asked(0.5) == 7
    f.answered({"version": 7, "filterable": True, "since": 7, "added": [], "removed": []})
    assert f.asked(1.5) is None


@pytest.mark.slow
def test_engine_skips_lookups_that_cannot_hit_and_still_hits_what_it_can(tmp_path):
    import time

    import torch

    from bench.kvd_process import KvdProcess
    from client.kvd_client import KvdClient
    from specd.engine.config import EngineConfig
    from specd.engine.engine import SpecEngine
    from tests.greedy_runs import greedy_run

    torch.set_num_threads(1)
    local = SpecEngine.from_config(EngineConfig(cuda_graphs=False))
    vocab = local.model.config.vocab_size
    g = torch.Generator().manual_seed(3)
    unique = [torch.randint(3, vocab, (70,), generator=g).tolist() for _ in range(6)]
    theirs = torch.randint(3, vocab, (70,), generator=g).tolist()
    want = {i: greedy_run(local, f"w{i}", p)[0] for i, p in enumerate(unique + [theirs])}
    with KvdProcess(tmp_path / "kvd", gpu_bytes=8 << 20, dram_bytes=0) as kvd:
        eng = SpecEngine.from_config(EngineConfig(kvd_run_dir=kvd.run_dir, cuda_graphs=False))
        other = SpecEngine.from_config(EngineConfig(kvd_run_dir=kvd.run_dir, cuda_graphs=False))
        for i, p in enumerate(unique):                     # the first request's step asks for the mirror
            got, usage = greedy_run(eng, f"u{i}", p)
            assert got == want[i] and usage.cached_tokens == 0
        stats = eng.stats()
        assert stats["kvd_lookups_skipped_total"] >= len(unique) - 2     # all but the first one or two
        got, usage = greedy_run(eng, "again", unique[2])   # its own commit made it hittable at once
        assert got == want[2] and usage.cached_tokens == 64
        assert greedy_run(other, "t", theirs)[0] == want[6]   # another client's prefix...
        time.sleep(eng.source.roots.refresh_s)
        greedy_run(eng, "tick", unique[0])                  # ...reaches the mirror with the next refresh
        got, usage = greedy_run(eng, "theirs", theirs)
        assert got == want[6] and usage.cached_tokens == 64
        with KvdClient(kvd.run_dir) as admin:
            kstats = admin.stats()
        assert kstats["lookups_skipped"] == eng.stats()["kvd_lookups_skipped_total"] - eng.source.roots.unreported[0]
        assert kstats["hit_rate"] < 0.5                     # the skipped lookups count as the misses they were
